// Row normalisations of f32 activations (variant OP): rms = RMSNorm; residual = RMSNorm of x + r,
// also writing x + r to SUM; residual_inplace = the same with x + r written back into x (the
// residual stream update; wgpu cannot bind one buffer as both SRC and SUM); gated = RMSNorm times SiLU(z); l2 = x / max(|x|, eps). One workgroup per
// row; a row is (token t, head h) at offset + t*token_stride + h*head_stride, so per-head norms over
// interleaved layouts (q/gate of full attention, q/k of the DeltaNet conv output) need no copy. The
// weight (length n) is shared by every head. The result is multiplied by `scale`.
#include "common.wgsl"
#include "common_reduce.wgsl"
#define WG 64
#define OP rms
#variants OP=residual
#variants OP=residual_inplace
#variants OP=gated
#variants OP=l2

// The immediates, declared with their field docs in rust/ops/norm.rs (NormParams).
#params NormParams

var<immediate> P: NormParams;
#if OP == residual_inplace
@group(0) @binding(0) var<storage, read_write> SRC: array<f32>;
#else
@group(0) @binding(0) var<storage, read> SRC: array<f32>;
#endif
#if OP == l2
@group(0) @binding(1) var<storage, read_write> DST: array<f32>;
#else
@group(0) @binding(1) var<storage, read> WEIGHT: array<f32>;
@group(0) @binding(2) var<storage, read_write> DST: array<f32>;
#endif
#if OP == residual
// The residual added to SRC (same layout), and where SRC + RESIDUAL goes (same layout).
@group(0) @binding(3) var<storage, read> RESIDUAL: array<f32>;
@group(0) @binding(4) var<storage, read_write> SUM: array<f32>;
#endif
#if OP == residual_inplace
@group(0) @binding(3) var<storage, read> RESIDUAL: array<f32>;
#endif
#if OP == gated
// The gate z, laid out like SRC.
@group(0) @binding(3) var<storage, read> GATE: array<f32>;
#endif

fn silu(x: f32) -> f32 {
    return x / (1.0 + exp(-x));
}

fn input_at(i: u32) -> f32 {
#if OP == residual
    return SRC[i] + RESIDUAL[i];
#else
#if OP == residual_inplace
    return SRC[i] + RESIDUAL[i];
#else
    return SRC[i];
#endif
#endif
}

@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
    let row = group_index(ids);
    if row >= P.tokens * P.heads {
        return;
    }
    let t = row / P.heads;
    let h = row % P.heads;
    let s = P.src_offset + t * P.src_token_stride + h * P.src_head_stride;
    let d = P.dst_offset + t * P.dst_token_stride + h * P.dst_head_stride;
    var sq = 0.0;
    for (var i = ids.lid; i < P.n; i += {{WG}}u) {
        let v = input_at(s + i);
#if OP == residual
        SUM[s + i] = v;
#endif
#if OP == residual_inplace
        // Element i is read and written by this invocation only, here and in the loop below.
        SRC[s + i] = v;
#endif
        sq += v * v;
    }
    let total = wg_sum(sq, ids);
#if OP == l2
    // llama.cpp form x / max(|x|, eps) (docs/numerics.md "Gated DeltaNet" step 5).
    let inv = P.scale / max(sqrt(total), P.eps);
#else
    let inv = inverseSqrt(total / f32(P.n) + P.eps) * P.scale;
#endif
    for (var i = ids.lid; i < P.n; i += {{WG}}u) {
#if OP == residual_inplace
        let v = SRC[s + i] * inv;
#else
        // Recomputed rather than read back from SUM (written by other invocations).
        let v = input_at(s + i) * inv;
#endif
#if OP == l2
        DST[d + i] = v;
#else
#if OP == gated
        DST[d + i] = v * WEIGHT[i] * silu(GATE[s + i]);
#else
        DST[d + i] = v * WEIGHT[i];
#endif
#endif
    }
}
