// Causal GQA softmax attention with the Qwen3-Next sigmoid output gate (docs/numerics.md "Gated attention").
//
// KV cache layout (one sequence): element (position p, kv head g, dim d) of K and of V lives at
// kv_offset + (p * kv_heads + g) * head_dim + d, i.e. token-major rows of kv_heads*head_dim, so
// appending tokens and snapshotting a prefix are contiguous ranges. Query row t sits at absolute
// position q_pos + t and sees cache positions 0..=q_pos+t (its own row is already in the cache).
// q head h uses kv head h / (heads / kv_heads). out = softmax(scale q.K) V, times sigmoid(gate) if
// `gated` (gate of head h at gate_offset + t*gate_token_stride + h*gate_head_stride, which for
// the interleaved q/gate projection is q's row shifted by head_dim).
//
// Variants (OP):
// * split + reduce: flash-decoding for few query rows and a long cache. split: grid (splits,
//   kv_heads, tokens); each workgroup scores split_len cache positions for all q heads sharing one
//   kv head (K/V read once per group) and writes a partial output with its max and sum. reduce:
//   grid (heads, tokens); merges the splits, normalises and gates.
// * prefill: grid (ceil(tokens / BQ), heads); tiles of BQ query rows x BK cache positions with an
//   online softmax; each query row is LANES invocations, each owning every LANES-th dim.
#include "common.wgsl"
#define WG 64
#define OP prefill
#variants OP=split
#variants OP=reduce

struct AttnParams {
    tokens: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    q_pos: u32,
    q_offset: u32,
    q_token_stride: u32,
    q_head_stride: u32,
    gate_offset: u32,
    gate_token_stride: u32,
    gate_head_stride: u32,
    kv_offset: u32,
    out_offset: u32,
    out_token_stride: u32,
    splits: u32,
    split_len: u32,
    scale: f32,
    gated: u32,
}

// Decode: the group's queries (group * head_dim <= MAX_GROUP_Q) and scores
// (group * split_len <= MAX_SCORES); prefill reuses both arrays for its K/V tile and partial dots.
const MAX_GROUP: u32 = 16u;
const MAX_GROUP_Q: u32 = 2048u;
const MAX_SCORES: u32 = 1024u;
const BQ: u32 = 16u;
const LANES: u32 = 4u;
const MAX_DIMS_PER_LANE: u32 = 64u;
const BK: u32 = 8u;
// Stands in for -inf: exp(MASKED - finite) is exactly 0 and never a NaN.
const MASKED: f32 = -3.0e38;

var<immediate> P: AttnParams;
#if OP == split
@group(0) @binding(0) var<storage, read> Q: array<f32>;
@group(0) @binding(1) var<storage, read> K_CACHE: array<f32>;
@group(0) @binding(2) var<storage, read> V_CACHE: array<f32>;
// Per (token, head, split): head_dim partial outputs, and (max, sum).
@group(0) @binding(3) var<storage, read_write> PART_O: array<f32>;
@group(0) @binding(4) var<storage, read_write> PART_ML: array<f32>;
#endif
#if OP == reduce
@group(0) @binding(0) var<storage, read> GATE: array<f32>;
@group(0) @binding(1) var<storage, read> PART_O: array<f32>;
@group(0) @binding(2) var<storage, read> PART_ML: array<f32>;
@group(0) @binding(3) var<storage, read_write> OUT: array<f32>;
#endif
#if OP == prefill
@group(0) @binding(0) var<storage, read> Q: array<f32>;
@group(0) @binding(1) var<storage, read> GATE: array<f32>;
@group(0) @binding(2) var<storage, read> K_CACHE: array<f32>;
@group(0) @binding(3) var<storage, read> V_CACHE: array<f32>;
@group(0) @binding(4) var<storage, read_write> OUT: array<f32>;
#endif

var<workgroup> group_q: array<f32, MAX_GROUP_Q>;
var<workgroup> scores: array<f32, MAX_SCORES>;
var<workgroup> group_max: array<f32, MAX_GROUP>;
var<workgroup> group_sum: array<f32, MAX_GROUP>;

fn kv_index(p: u32, g: u32, d: u32) -> u32 {
    return P.kv_offset + (p * P.kv_heads + g) * P.head_dim + d;
}

fn q_index(t: u32, h: u32, d: u32) -> u32 {
    return P.q_offset + t * P.q_token_stride + h * P.q_head_stride + d;
}

#if OP != split
fn gate_factor(t: u32, h: u32, d: u32) -> f32 {
    if P.gated == 0u {
        return 1.0;
    }
    let z = GATE[P.gate_offset + t * P.gate_token_stride + h * P.gate_head_stride + d];
    return 1.0 / (1.0 + exp(-z));
}
#endif

#if OP == split
@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
    let lid = ids.lid;
    let split = ids.wid.x;
    let kvh = ids.wid.y;
    let t = ids.wid.z;
    let hd = P.head_dim;
    let group = P.heads / P.kv_heads;
    let kv_len = P.q_pos + t + 1u;
    let start = split * P.split_len;
    let end = min(start + P.split_len, kv_len);
    let count = select(0u, end - start, end > start);

    for (var i = lid; i < group * hd; i += {{WG}}u) {
        group_q[i] = Q[q_index(t, kvh * group + i / hd, i % hd)] * P.scale;
    }
    workgroupBarrier();
    // One (position, head) score per step; neighbouring invocations share the K row in cache.
    for (var item = lid; item < count * group; item += {{WG}}u) {
        let p = item / group;
        let g = item % group;
        var acc = 0.0;
        for (var d = 0u; d < hd; d++) {
            acc += group_q[g * hd + d] * K_CACHE[kv_index(start + p, kvh, d)];
        }
        scores[g * P.split_len + p] = acc;
    }
    workgroupBarrier();
    if lid < group {
        var m = MASKED;
        for (var p = 0u; p < count; p++) {
            m = max(m, scores[lid * P.split_len + p]);
        }
        var l = 0.0;
        for (var p = 0u; p < count; p++) {
            let e = exp(scores[lid * P.split_len + p] - m);
            scores[lid * P.split_len + p] = e;
            l += e;
        }
        group_max[lid] = m;
        group_sum[lid] = l;
    }
    workgroupBarrier();
    // One (head, dim) output per step: a scalar accumulator, no dynamically indexed private array
    // (compilers keep those in memory).
    for (var item = lid; item < group * hd; item += {{WG}}u) {
        let g = item / hd;
        let d = item % hd;
        var acc = 0.0;
        for (var p = 0u; p < count; p++) {
            acc += scores[g * P.split_len + p] * V_CACHE[kv_index(start + p, kvh, d)];
        }
        let slot = (t * P.heads + kvh * group + g) * P.splits + split;
        PART_O[slot * hd + d] = acc;
    }
    if lid < group {
        let slot = (t * P.heads + kvh * group + lid) * P.splits + split;
        PART_ML[slot * 2u] = group_max[lid];
        PART_ML[slot * 2u + 1u] = group_sum[lid];
    }
}
#endif

#if OP == reduce
@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
    let h = ids.wid.x;
    let t = ids.wid.y;
    let hd = P.head_dim;
    let first = (t * P.heads + h) * P.splits;
    var m = MASKED;
    for (var s = 0u; s < P.splits; s++) {
        m = max(m, PART_ML[(first + s) * 2u]);
    }
    var l = 0.0;
    for (var s = 0u; s < P.splits; s++) {
        l += PART_ML[(first + s) * 2u + 1u] * exp(PART_ML[(first + s) * 2u] - m);
    }
    for (var d = ids.lid; d < hd; d += {{WG}}u) {
        var acc = 0.0;
        for (var s = 0u; s < P.splits; s++) {
            acc += PART_O[(first + s) * hd + d] * exp(PART_ML[(first + s) * 2u] - m);
        }
        OUT[P.out_offset + t * P.out_token_stride + h * hd + d] = acc / l * gate_factor(t, h, d);
    }
}
#endif

#if OP == prefill
@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
    let lid = ids.lid;
    let h = ids.wid.y;
    let hd = P.head_dim;
    let kvh = h / (P.heads / P.kv_heads);
    let row = lid / LANES;
    let lane = lid % LANES;
    let t = ids.wid.x * BQ + row;
    let row_valid = t < P.tokens;

    var q_reg: array<f32, MAX_DIMS_PER_LANE>;
    var o_reg: array<f32, MAX_DIMS_PER_LANE>;
    // Loops over the register arrays run a constant MAX_DIMS_PER_LANE times so compilers can
    // unroll them and keep the arrays in registers.
    for (var i = 0u; i < MAX_DIMS_PER_LANE; i++) {
        let d = lane + i * LANES;
        q_reg[i] = 0.0;
        o_reg[i] = 0.0;
        if row_valid && d < hd {
            q_reg[i] = Q[q_index(t, h, d)] * P.scale;
        }
    }
    var m = MASKED;
    var l = 0.0;
    // The workgroup needs cache positions up to its last row's (uniform across the workgroup).
    let last_row = min(ids.wid.x * BQ + BQ, P.tokens) - 1u;
    let kv_end = P.q_pos + last_row + 1u;
    let my_end = P.q_pos + t + 1u;
    let tile_len = BK * hd;
    for (var p0 = 0u; p0 < kv_end; p0 += BK) {
        for (var i = lid; i < tile_len; i += {{WG}}u) {
            let p = p0 + i / hd;
            group_q[i] = select(0.0, K_CACHE[kv_index(min(p, kv_end - 1u), kvh, i % hd)], p < kv_end);
        }
        workgroupBarrier();
        for (var j = 0u; j < BK; j++) {
            var acc = 0.0;
            for (var i = 0u; i < MAX_DIMS_PER_LANE; i++) {
                let d = lane + i * LANES;
                if d < hd {
                    acc += q_reg[i] * group_q[j * hd + d];
                }
            }
            scores[lid * BK + j] = acc;
        }
        workgroupBarrier();
        var p_row: array<f32, BK>;
        var tile_max = MASKED;
        for (var j = 0u; j < BK; j++) {
            var s = 0.0;
            for (var ln = 0u; ln < LANES; ln++) {
                s += scores[(row * LANES + ln) * BK + j];
            }
            if p0 + j >= my_end {
                s = MASKED;
            }
            p_row[j] = s;
            tile_max = max(tile_max, s);
        }
        let m_new = max(m, tile_max);
        let correction = exp(m - m_new);
        l = l * correction;
        for (var j = 0u; j < BK; j++) {
            // Masked entries give exactly 0 even while m_new is still MASKED.
            let e = select(exp(p_row[j] - m_new), 0.0, p_row[j] == MASKED);
            p_row[j] = e;
            l += e;
        }
        m = m_new;
        workgroupBarrier();
        for (var i = lid; i < tile_len; i += {{WG}}u) {
            let p = p0 + i / hd;
            group_q[i] = select(0.0, V_CACHE[kv_index(min(p, kv_end - 1u), kvh, i % hd)], p < kv_end);
        }
        workgroupBarrier();
        for (var i = 0u; i < MAX_DIMS_PER_LANE; i++) {
            let d = lane + i * LANES;
            if d < hd {
                var acc = o_reg[i] * correction;
                for (var j = 0u; j < BK; j++) {
                    acc += p_row[j] * group_q[j * hd + d];
                }
                o_reg[i] = acc;
            }
        }
        workgroupBarrier();
    }
    if row_valid {
        for (var i = 0u; i < MAX_DIMS_PER_LANE; i++) {
            let d = lane + i * LANES;
            if d < hd {
                OUT[P.out_offset + t * P.out_token_stride + h * hd + d] = o_reg[i] / l * gate_factor(t, h, d);
            }
        }
    }
}
#endif
