// Mat-vec for decode: Y[:, c] = W · X[:, c] for NC activation columns (1..8) that share one read of
// the weights, W in any ggml type (dequantised on the fly by common_dequant), X and Y f32.
// A workgroup computes NR consecutive rows; its WG invocations stride over K, then reduce across the
// workgroup. IQ4_XS (the bulk of the weights) has its own step: one coalesced quant word per
// invocation, all 8 nibbles decoded, looked up in workgroup memory (the 4-bit decode was bound by
// instructions per byte on the H200); every other type goes 8 weights at a time through
// common_dequant. With MOE=1 the grid is (row groups, n_used, tokens) and each
// workgroup reads its expert id from IDS (no CPU round trip) and skips experts outside this window.
#include "common.wgsl"
#include "common_dequant.wgsl"
#include "common_reduce.wgsl"
#define QTYPE q8_0
#define NC 1
#define NR 2
#define ACC4 1
#define WG 64
#define MOE 0
#variants QTYPE=f32
#variants QTYPE=f16 NC=4 ACC4=2
#variants QTYPE=bf16
#variants QTYPE=q4_0
#variants QTYPE=q4_k NC=8 NR=4 ACC4=8
#variants QTYPE=q5_k
#variants QTYPE=q6_k NC=2
#variants QTYPE=iq4_nl
#variants QTYPE=iq4_xs MOE=1
#variants QTYPE=iq4_xs WG=128 NR=4 ACC4=2
#variants QTYPE=iq4_xs NC=8 NR=2 ACC4=4
#variants QTYPE=q8_0 NC=3 NR=2 ACC4=2 MOE=1

struct MatvecParams {
    // Weights per row, rows to compute (per expert with MOE), bytes per row.
    k: u32,
    rows: u32,
    row_bytes: u32,
    // Byte offset in W of this window's first row.
    w_offset: u32,
    // Float index of X column 0 and floats between columns (both multiples of 4).
    x_offset: u32,
    x_stride: u32,
    // Float index of Y row 0 of column 0, and floats between output columns.
    y_offset: u32,
    y_stride: u32,
    // MOE: index of the first id in IDS, ids per token (n_used), experts held by this window.
    ids_offset: u32,
    n_used: u32,
    expert_first: u32,
    expert_count: u32,
    // MOE: X column = token * x_col_token + slot * x_col_slot.
    x_col_token: u32,
    x_col_slot: u32,
}

var<immediate> P: MatvecParams;
@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
#if MOE
@group(0) @binding(3) var<storage, read> IDS: array<u32>;

var<workgroup> moe_expert: u32;
#endif

#if QTYPE == iq4_xs
// kvalues_iq4nl as floats: a 16-entry table in workgroup memory is one shared load per weight (no
// bank conflicts: distinct entries sit in distinct banks), fewer instructions than select chains.
var<workgroup> kv_table: array<f32, 16>;
#endif

@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
#if QTYPE == iq4_xs
    if ids.lid < 16u {
        kv_table[ids.lid] = kv_iq4nl4(vec4<u32>(ids.lid)).x;
    }
    workgroupBarrier();
#endif
#if MOE
    let row0 = ids.wid.x * {{NR}}u;
    let slot = ids.wid.y;
    let token = ids.wid.z;
    if ids.lid == 0u {
        moe_expert = IDS[P.ids_offset + token * P.n_used + slot];
    }
    // Uniform across the workgroup, so the early exit keeps the reduction's barriers uniform.
    let expert = workgroupUniformLoad(&moe_expert);
    if expert < P.expert_first || expert >= P.expert_first + P.expert_count {
        return;
    }
    let w_base = P.w_offset + (expert - P.expert_first) * P.rows * P.row_bytes;
    let x_col0 = token * P.x_col_token + slot * P.x_col_slot;
    let y_base = P.y_offset + (token * P.n_used + slot) * P.y_stride;
#else
    let row0 = group_index(ids) * {{NR}}u;
    let w_base = P.w_offset;
    let x_col0 = 0u;
    let y_base = P.y_offset;
#endif
    if row0 >= P.rows {
        return;
    }
    var acc: array<vec4<f32>, {{ACC4}}>;
    let x_base = (P.x_offset + x_col0 * P.x_stride) / 4u;
    let x_col = P.x_stride / 4u;
    var generic = true;
#if QTYPE == iq4_xs
    // Invocation j takes quant word j of the row (block j / 32, word i = j % 32 of its 128 quant
    // bytes), so a subgroup reads a block's 128 bytes in one coalesced load and its 8-byte header
    // as a broadcast. Word i belongs to sub-block i / 4: its low nibbles are weights 4(i % 4)..+3
    // of that sub-block and its high nibbles the same 16 further on. IQ4_XS rows (136-byte
    // multiples) always start 4-aligned.
    generic = false;
    for (var j = ids.lid; j < P.k / 8u; j += {{WG}}u) {
        let i = j & 31u;
        let ib = i >> 2u;
        let xv = x_base + 64u * (j >> 5u) + 8u * ib + (i & 3u);
        var xl: array<vec4<f32>, {{NC}}>;
        var xh: array<vec4<f32>, {{NC}}>;
#for c in 0..NC
        xl[{{c}}] = X[xv + {{c}}u * x_col];
        xh[{{c}}] = X[xv + {{c}}u * x_col + 4u];
#endfor
#for r in 0..NR
        if row0 + {{r}}u < P.rows {
            let blk = (w_base + (row0 + {{r}}u) * P.row_bytes) / 4u + 34u * (j >> 5u);
            let h0 = W[blk];
            let h1 = W[blk + 1u];
            let q = W[blk + 2u + i];
            let ls = ((h1 >> (4u * ib)) & 15u) | (((h0 >> (16u + 2u * ib)) & 3u) << 4u);
            let dl = unpack2x16float(h0).x * (f32(ls) - 32.0);
            let lo = unpack4xU8(q & 0x0f0f0f0fu);
            let hi = unpack4xU8((q >> 4u) & 0x0f0f0f0fu);
            let wl = vec4<f32>(kv_table[lo.x], kv_table[lo.y], kv_table[lo.z], kv_table[lo.w]);
            let wh = vec4<f32>(kv_table[hi.x], kv_table[hi.y], kv_table[hi.z], kv_table[hi.w]);
#for c in 0..NC
            acc[({{r}}u * {{NC}}u + {{c}}u) / 4u][({{r}}u * {{NC}}u + {{c}}u) % 4u] += dl * (dot(wl, xl[{{c}}]) + dot(wh, xh[{{c}}]));
#endfor
        }
#endfor
    }
#endif
    if generic {
        for (var g = ids.lid; g < P.k / 8u; g += {{WG}}u) {
            // Unrolled (#for): constant indices keep xa, xb and acc in registers.
            var xa: array<vec4<f32>, {{NC}}>;
            var xb: array<vec4<f32>, {{NC}}>;
#for c in 0..NC
            xa[{{c}}] = X[x_base + {{c}}u * x_col + 2u * g];
            xb[{{c}}] = X[x_base + {{c}}u * x_col + 2u * g + 1u];
#endfor
#for r in 0..NR
            if row0 + {{r}}u < P.rows {
                let w = dq8_{{QTYPE}}(w_base + (row0 + {{r}}u) * P.row_bytes, g);
#for c in 0..NC
                acc[({{r}}u * {{NC}}u + {{c}}u) / 4u][({{r}}u * {{NC}}u + {{c}}u) % 4u] += dot(w.a, xa[{{c}}]) + dot(w.b, xb[{{c}}]);
#endfor
            }
#endfor
        }
    }
#for a in 0..ACC4
    acc[{{a}}] = wg_sum4(acc[{{a}}], ids);
#endfor
    let i = ids.lid;
    if i < {{NR}}u * {{NC}}u {
        let r = i / {{NC}}u;
        let c = i % {{NC}}u;
        if row0 + r < P.rows {
            Y[y_base + c * P.y_stride + row0 + r] = acc[i / 4u][i % 4u];
        }
    }
}
