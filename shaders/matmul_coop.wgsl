// Cooperative-matrix mat-mat for prefill (tensor cores where wgpu's experimental cooperative-matrix
// feature exists): Y[:, n] = W · X[:, n], W in any ggml type, X and Y f32 column-major as in
// matmul.wgsl. A workgroup of 4 subgroups (SG lanes each) computes a 64 (rows) × 64 (columns) tile;
// subgroup s owns the 32×32 quarter (s & 1, s >> 1) as 2×2 accumulators of 16×16. Per 32-wide K
// step the workgroup dequantises its W rows to f16 and converts its X columns to f16 in workgroup
// memory, then each subgroup runs 2 (K) × 2×2 multiply-adds. Accumulators are ACC (f32 where the
// device offers f16×f16→f32, else f16). Inputs in f16 lose precision (11-bit mantissa) and range
// (|x| ≤ 65504): the tests state the tolerance. K not a multiple of 32 is zero-padded in the tile.
//
// Only 16×16×16 configurations are used: naga's WGSL has square 8×8 and 16×16 matrices, and 16×16
// f16 is what Vulkan drivers with tensor cores offer. Metal's simdgroup matrices are 8×8, so this
// shader is never chosen there (the runtime picks it from the adapter's configuration list).
enable f16;
enable wgpu_cooperative_matrix;
#include "common.wgsl"
#include "common_dequant.wgsl"
#define QTYPE q8_0
#define SG 32
#define ACC f32
#variants QTYPE=f32
#variants QTYPE=f16
#variants QTYPE=bf16
#variants QTYPE=q4_0
#variants QTYPE=q4_k
#variants QTYPE=q5_k
#variants QTYPE=q6_k
#variants QTYPE=iq4_nl
#variants QTYPE=iq4_xs ACC=f16
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
const TK = 32u;
// Row pitch of the f16 tiles in halves: 32 + 8 keeps every 16×16 load 16-byte aligned (80-byte
// rows) while shifting successive rows across memory banks.
const LD = 40u;
const THREADS = 4u * {{SG}}u;

var<workgroup> w_tile: array<f16, 2560>; // TM × LD, row-major (m, k)
var<workgroup> x_tile: array<f16, 2560>; // TN × LD, column n holds its k contiguous
var<workgroup> c_tile: array<{{ACC}}, 4096>; // TM × TN, column-major like Y

@compute @workgroup_size(4 * {{SG}})
fn main(ids: ComputeIds) {
    let m0 = ids.wid.x * TM;
    let n0 = ids.wid.y * TN;
    let t = ids.lid;
#if SUBGROUPS
    let sg = ids.sg_id;
#else
    // Without the subgroup built-ins the runtime only picks this shader on devices whose subgroup
    // size is fixed at SG, where subgroups are consecutive invocation ranges.
    let sg = t / {{SG}}u;
#endif
    let sm = 32u * (sg & 1u);
    let sn = 32u * (sg >> 1u);
    let groups = P.k / 8u;
    var acc00: coop_mat16x16<{{ACC}}, C>;
    var acc01: coop_mat16x16<{{ACC}}, C>;
    var acc10: coop_mat16x16<{{ACC}}, C>;
    var acc11: coop_mat16x16<{{ACC}}, C>;
    for (var k0 = 0u; k0 < P.k; k0 += TK) {
        // W: 64 rows × 4 groups of 8 weights; neighbouring invocations take neighbouring groups.
        for (var e = t; e < TM * 4u; e += THREADS) {
            let row = e / 4u;
            let grp = e % 4u;
            let g = k0 / 8u + grp;
            var w = W8(vec4<f32>(0.0), vec4<f32>(0.0));
            if m0 + row < P.rows && g < groups {
                w = dq8_{{QTYPE}}(P.w_offset + (m0 + row) * P.row_bytes, g);
            }
            let at = row * LD + 8u * grp;
#for i in 0..4
            w_tile[at + {{i}}u] = f16(w.a[{{i}}]);
            w_tile[at + 4u + {{i}}u] = f16(w.b[{{i}}]);
#endfor
        }
        // X: 64 columns × 8 vec4 of K.
        for (var e = t; e < TN * 8u; e += THREADS) {
            let xn = e / 8u;
            let xk4 = e % 8u;
            var v = vec4<f32>(0.0);
            if n0 + xn < P.n && k0 + 4u * xk4 < P.k {
                v = X[(P.x_offset + (n0 + xn) * P.x_stride + k0) / 4u + xk4];
            }
            let at = xn * LD + 4u * xk4;
#for i in 0..4
            x_tile[at + {{i}}u] = f16(v[{{i}}]);
#endfor
        }
        workgroupBarrier();
#for kk in 0..2
        {
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&w_tile[sm * LD + 16u * {{kk}}u], LD);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&w_tile[(sm + 16u) * LD + 16u * {{kk}}u], LD);
            let b0 = coopLoad<coop_mat16x16<f16, B>>(&x_tile[sn * LD + 16u * {{kk}}u], LD);
            let b1 = coopLoad<coop_mat16x16<f16, B>>(&x_tile[(sn + 16u) * LD + 16u * {{kk}}u], LD);
            acc00 = coopMultiplyAdd(a0, b0, acc00);
            acc01 = coopMultiplyAdd(a0, b1, acc01);
            acc10 = coopMultiplyAdd(a1, b0, acc10);
            acc11 = coopMultiplyAdd(a1, b1, acc11);
        }
#endfor
        workgroupBarrier();
    }
    // Through workgroup memory so edge tiles can be clipped per element.
    coopStore(acc00, &c_tile[sn * TM + sm], TM);
    coopStore(acc10, &c_tile[sn * TM + sm + 16u], TM);
    coopStore(acc01, &c_tile[(sn + 16u) * TM + sm], TM);
    coopStore(acc11, &c_tile[(sn + 16u) * TM + sm + 16u], TM);
    workgroupBarrier();
    for (var e = t; e < TM * TN; e += THREADS) {
        let m = e % TM;
        let n = e / TM;
        if m0 + m < P.rows && n0 + n < P.n {
            Y[P.y_offset + (n0 + n) * P.y_stride + m0 + m] = f32(c_tile[e]);
        }
    }
}
