// Tiled mat-mat for prefill: Y[:, n] = W · X[:, n] for many activation columns (tokens), W in any
// ggml type (dequantised once per tile into workgroup memory), X and Y f32, column-major (a
// column's K or M floats are contiguous). A workgroup of 256 computes a 64 (rows) × 64 (columns)
// tile; each invocation owns 4×4 outputs strided by 16 so neighbours read neighbouring rows. K
// advances 32 at a time; a K that is not a multiple of 32 is padded with zeros in the tile.
#include "common.wgsl"
#include "common_dequant.wgsl"
#define QTYPE q8_0
#variants QTYPE=f32
#variants QTYPE=f16
#variants QTYPE=bf16
#variants QTYPE=q4_0
#variants QTYPE=q4_k
#variants QTYPE=q5_k
#variants QTYPE=q6_k
#variants QTYPE=iq4_nl
#variants QTYPE=iq4_xs
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

struct MatmulParams {
    // Weights per row, rows in this window, bytes per row, byte offset of row 0 in W.
    k: u32,
    rows: u32,
    row_bytes: u32,
    w_offset: u32,
    // Activation columns; X column n starts at float x_offset + n * x_stride (multiples of 4).
    n: u32,
    x_offset: u32,
    x_stride: u32,
    // Y[y_offset + n * y_stride + m].
    y_offset: u32,
    y_stride: u32,
}

var<immediate> P: MatmulParams;
@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;

const TM = 64u;
const TN = 64u;
// K per tile in vec4s (32 weights).
const TK4 = 8u;

var<workgroup> w_tile: array<vec4<f32>, 512>; // TM × TK4
var<workgroup> x_tile: array<vec4<f32>, 512>; // TN × TK4

@compute @workgroup_size(256)
fn main(ids: ComputeIds) {
    let m0 = ids.wid.x * TM;
    let n0 = ids.wid.y * TN;
    let t = ids.lid;
    let tx = t % 16u;
    let ty = t / 16u;
    let groups = P.k / 8u;
    var acc: array<vec4<f32>, 4>;
    // This invocation's share of the tile loads: one 8-weight group of W, two vec4 of X.
    let w_row = t / 4u;
    let w_grp = t % 4u;
    let w_ok = m0 + w_row < P.rows;
    let w_base = P.w_offset + (m0 + w_row) * P.row_bytes;
    for (var k0 = 0u; k0 < P.k; k0 += 32u) {
        let g = k0 / 8u + w_grp;
        var w = W8(vec4<f32>(0.0), vec4<f32>(0.0));
        if w_ok && g < groups {
            w = dq8_{{QTYPE}}(w_base, g);
        }
        w_tile[w_row * TK4 + 2u * w_grp] = w.a;
        w_tile[w_row * TK4 + 2u * w_grp + 1u] = w.b;
        for (var h = 0u; h < 2u; h++) {
            let e = t + 256u * h;
            let xn = e / TK4;
            let xk4 = e % TK4;
            var v = vec4<f32>(0.0);
            if n0 + xn < P.n && k0 + 4u * xk4 < P.k {
                v = X[(P.x_offset + (n0 + xn) * P.x_stride + k0) / 4u + xk4];
            }
            x_tile[xn * TK4 + xk4] = v;
        }
        workgroupBarrier();
        // Unrolled (#for) so a and acc keep constant indices and stay in registers.
        for (var k4 = 0u; k4 < TK4; k4++) {
            var a: array<vec4<f32>, 4>;
#for i in 0..4
            a[{{i}}] = w_tile[(ty + 16u * {{i}}u) * TK4 + k4];
#endfor
#for j in 0..4
            let b{{j}} = x_tile[(tx + 16u * {{j}}u) * TK4 + k4];
            acc[{{j}}] += vec4<f32>(dot(a[0], b{{j}}), dot(a[1], b{{j}}), dot(a[2], b{{j}}), dot(a[3], b{{j}}));
#endfor
        }
        workgroupBarrier();
    }
#for j in 0..4
    if n0 + tx + 16u * {{j}}u < P.n {
#for i in 0..4
        if m0 + ty + 16u * {{i}}u < P.rows {
            Y[P.y_offset + (n0 + tx + 16u * {{j}}u) * P.y_stride + m0 + ty + 16u * {{i}}u] = acc[{{j}}][{{i}}];
        }
#endfor
    }
#endfor
}
