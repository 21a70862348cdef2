// Partial NeoX rotary embedding, in place: for each (token, head) the pairs (i, i + n_rot/2),
// i < n_rot/2, of the first n_rot dims are rotated by pos * theta_i, theta_i = base^(-2i/n_rot);
// the other dims are untouched. One invocation per pair. theta_i comes from FREQS, computed on the
// host in f64 (in f32 on the GPU, exp2 of an exponent up to ~23 loses ~1e-6 relative, i.e. ~0.3 rad
// at position 262144). Token t is at position pos_base + t, or (variant
// POSITIONS=1) pos_base + POSITIONS[t] (several sequences in one step). For text input the qwen35
// IMROPE is exactly this (docs/numerics.md "Gated attention" step 3).
#include "common.wgsl"
#define WG 64
#define POSITIONS 0
#variants POSITIONS=1

struct RopeParams {
    tokens: u32,
    heads: u32,
    n_rot: u32,
    offset: u32,
    token_stride: u32,
    head_stride: u32,
    pos_base: u32,
}

// 2*pi split into a short head (exactly 201/32, so k * HEAD is exact for k < 2^16) and the rest:
// the reduction below stays accurate up to angles of ~4e5 rad (262144 positions * theta_0 = 1).
const TWO_PI: f32 = 6.283185307179586;
const TWO_PI_HEAD: f32 = 6.28125;
const TWO_PI_TAIL: f32 = 0.0019353071795864769;

var<immediate> P: RopeParams;
@group(0) @binding(0) var<storage, read_write> X: array<f32>;
@group(0) @binding(1) var<storage, read> FREQS: array<f32>;
#if POSITIONS
@group(0) @binding(2) var<storage, read> POS: array<u32>;
#endif

@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
    let half = P.n_rot / 2u;
    let index = group_index(ids) * {{WG}}u + ids.lid;
    if index >= P.tokens * P.heads * half {
        return;
    }
    let i = index % half;
    let h = (index / half) % P.heads;
    let t = index / (half * P.heads);
#if POSITIONS
    let pos = P.pos_base + POS[t];
#else
    let pos = P.pos_base + t;
#endif
    // The angle is rounded to f32 as llama.cpp does; only its reduction to [-pi, pi] is done
    // carefully, because Vulkan bounds sin/cos error only inside that range.
    let angle = f32(pos) * FREQS[i];
    let k = round(angle / TWO_PI);
    let reduced = (angle - k * TWO_PI_HEAD) - k * TWO_PI_TAIL;
    let c = cos(reduced);
    let s = sin(reduced);
    let base = P.offset + t * P.token_stride + h * P.head_stride + i;
    let x0 = X[base];
    let x1 = X[base + half];
    X[base] = x0 * c - x1 * s;
    X[base + half] = x0 * s + x1 * c;
}
