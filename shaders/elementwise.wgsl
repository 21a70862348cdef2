// Small fused element-wise ops on f32 rows (variant OP): silu_mul = SiLU(a) * b; add = a + b;
// mul_sigmoid = a * sigmoid(b); copy = a (e.g. V rows into the KV cache); moe_combine =
// sum_e w_e * a_e + sigmoid(gate) * b, optionally added to out (the residual stream); moe_sum =
// sum_e w_e * a_e (the decode step's combine, whose shared expert is one of the e), likewise.
// Operand X of row r, element i sits at x_offset + r * x_stride + i. One invocation per element.
#include "common.wgsl"
#define WG 64
#define OP add
#variants OP=silu_mul
#variants OP=mul_sigmoid
#variants OP=copy
#variants OP=moe_combine
#variants OP=moe_sum

// The immediates, declared with their field docs in rust/ops/elementwise.rs (EwParams).
#params EwParams

var<immediate> P: EwParams;
@group(0) @binding(0) var<storage, read> A: array<f32>;
#if OP == copy
@group(0) @binding(1) var<storage, read_write> OUT: array<f32>;
#else
#if OP == moe_sum
@group(0) @binding(1) var<storage, read_write> OUT: array<f32>;
@group(0) @binding(2) var<storage, read> WEIGHTS: array<f32>;
#else
@group(0) @binding(1) var<storage, read> B: array<f32>;
@group(0) @binding(2) var<storage, read_write> OUT: array<f32>;
#endif
#endif
#if OP == moe_combine
@group(0) @binding(3) var<storage, read> WEIGHTS: array<f32>;
@group(0) @binding(4) var<storage, read> GATE: array<f32>;
#endif

fn sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
    let idx = group_index(ids) * {{WG}}u + ids.lid;
    if idx >= P.rows * P.n {
        return;
    }
    let r = idx / P.n;
    let i = idx % P.n;
    let a = P.a_offset + r * P.a_stride + i;
    let o = P.out_offset + r * P.out_stride + i;
#if OP == copy
    OUT[o] = A[a];
#else
#if OP == moe_sum
    var acc = 0.0;
    for (var e = 0u; e < P.experts; e++) {
        acc += WEIGHTS[P.weights_offset + r * P.weights_stride + e] * A[a + e * P.n];
    }
    if P.accumulate != 0u {
        acc += OUT[o];
    }
    OUT[o] = acc;
#else
    let b = P.b_offset + r * P.b_stride + i;
#if OP == add
    OUT[o] = A[a] + B[b];
#endif
#if OP == silu_mul
    OUT[o] = A[a] * sigmoid(A[a]) * B[b];
#endif
#if OP == mul_sigmoid
    OUT[o] = A[a] * sigmoid(B[b]);
#endif
#if OP == moe_combine
    var acc = 0.0;
    for (var e = 0u; e < P.experts; e++) {
        acc += WEIGHTS[P.weights_offset + r * P.weights_stride + e] * A[a + e * P.n];
    }
    acc += sigmoid(GATE[P.gate_offset + r * P.gate_stride]) * B[b];
    if P.accumulate != 0u {
        acc += OUT[o];
    }
    OUT[o] = acc;
#endif
#endif
#endif
}
