// Tiled mat-mat for prefill: Y[:, n] = W · X[:, n] for many activation columns (tokens), W in any
// ggml type (dequantised once per tile into workgroup memory), X and Y f32, column-major (a
// column's K or M floats are contiguous). A workgroup of 256 computes a 64 (rows) × TN (columns)
// tile; each invocation owns 4 × NJ outputs strided by 16 so neighbours read neighbouring rows. K
// advances 32 at a time; a K that is not a multiple of 32 is padded with zeros in the tile. TN is
// 64 for dense products and 16 for the grouped MoE product (MOE 1: a tile is one expert's
// columns, common_matmul.wgsl), whose experts see about n_used·tokens/experts columns each.
// Every output is the same sum in the same order whatever tile or grouping it lands in; a split-K
// dispatch (common_matmul.wgsl) sums its workgroup's K range only.
#include "common.wgsl"
#include "common_dequant.wgsl"
#include "common_matmul.wgsl"
#define QTYPE q8_0
#define TN 64
#define NJ 4
#define MOE 0
#variants QTYPE=f32
#variants QTYPE=f16
#variants QTYPE=bf16
#variants QTYPE=q4_0
#variants QTYPE=q4_k
#variants QTYPE=q5_k
#variants QTYPE=q6_k
#variants QTYPE=iq4_nl
#variants QTYPE=iq4_xs
#variants QTYPE=iq4_xs TN=16 NJ=1 MOE=1
#variants QTYPE=q8_0 TN=16 NJ=1 MOE=1
#variants QTYPE=q4_1
#variants QTYPE=q5_0
#variants QTYPE=q5_1
#variants QTYPE=q2_k
#variants QTYPE=q3_k
#variants QTYPE=iq1_s
#variants QTYPE=iq1_m
#variants QTYPE=iq2_xxs
#variants QTYPE=iq2_xs
#variants QTYPE=iq2_s
#variants QTYPE=iq3_xxs
#variants QTYPE=iq3_s
#variants QTYPE=mxfp4

const TM = 64u;
// K per tile in vec4s (32 weights).
const TK4 = 8u;
// Tile row pitch in vec4s: TK4 + 1. With a pitch of TK4 (128 bytes) the 16 rows (columns) a warp's
// vec4 loads of one k4 touch all sat in the same four banks (16-way conflicts); 144 bytes apart
// they spread over all 32 (the 2 wavefronts a 16-address vec4 load needs at least).
const LDT = TK4 + 1u;
// X vec4 loads per invocation and K step.
const XH = ({{TN}}u * TK4 + 255u) / 256u;

var<workgroup> w_tile: array<vec4<f32>, 64 * 9>; // TM × LDT
var<workgroup> x_tile: array<vec4<f32>, {{TN}} * 9>; // TN × LDT

@compute @workgroup_size(256)
fn main(ids: ComputeIds) {
    let m0 = ids.wid.x * TM;
    let t = ids.lid;
    col_tile_read(t, ids.wid.y, {{TN}}u);
    let tile = col_tile();
    if tile.cols == 0u {
        return;
    }
    let tx = t % 16u;
    let ty = t / 16u;
    let groups = P.k / 8u;
    var acc: array<vec4<f32>, {{NJ}}>;
    // This invocation's share of the tile loads: one 8-weight group of W, XH vec4 of X (the same
    // columns every K step, so their starts are found once).
    let w_row = t / 4u;
    let w_grp = t % 4u;
    let w_ok = m0 + w_row < P.rows;
    let w_base = tile.w_base + (m0 + w_row) * P.row_bytes;
    var x_start: array<u32, XH>;
    for (var h = 0u; h < XH; h++) {
        let xn = (t + 256u * h) / TK4;
        if xn < tile.cols {
            x_start[h] = x_col_start(tile, xn);
        }
    }
    let kr = k_range(ids.wid.z);
    for (var k0 = kr.x; k0 < kr.y; k0 += 32u) {
        let g = k0 / 8u + w_grp;
        var w = W8(vec4<f32>(0.0), vec4<f32>(0.0));
        if w_ok && g < groups {
            w = dq8_{{QTYPE}}(w_base, g);
        }
        w_tile[w_row * LDT + 2u * w_grp] = w.a;
        w_tile[w_row * LDT + 2u * w_grp + 1u] = w.b;
        for (var h = 0u; h < XH; h++) {
            let e = t + 256u * h;
            let xn = e / TK4;
            let xk4 = e % TK4;
            if xn < {{TN}}u {
                var v = vec4<f32>(0.0);
                if xn < tile.cols && k0 + 4u * xk4 < P.k {
                    v = X[(x_start[h] + k0) / 4u + xk4];
                }
                x_tile[xn * LDT + xk4] = v;
            }
        }
        workgroupBarrier();
        // Unrolled (#for) so a and acc keep constant indices and stay in registers.
        for (var k4 = 0u; k4 < TK4; k4++) {
            var a: array<vec4<f32>, 4>;
#for i in 0..4
            a[{{i}}] = w_tile[(ty + 16u * {{i}}u) * LDT + k4];
#endfor
#for j in 0..NJ
            let b{{j}} = x_tile[(tx + 16u * {{j}}u) * LDT + k4];
            acc[{{j}}] += vec4<f32>(dot(a[0], b{{j}}), dot(a[1], b{{j}}), dot(a[2], b{{j}}), dot(a[3], b{{j}}));
#endfor
        }
        workgroupBarrier();
    }
#for j in 0..NJ
    if tx + 16u * {{j}}u < tile.cols {
        let y0 = y_col_start(tile, tx + 16u * {{j}}u, ids.wid.z) + m0 + ty;
#for i in 0..4
        if m0 + ty + 16u * {{i}}u < P.rows {
            Y[y0 + 16u * {{i}}u] = acc[{{j}}][{{i}}];
        }
#endfor
    }
#endfor
}
