// Causal GQA softmax attention with the Qwen3-Next sigmoid output gate (spec model.md §3.5).
//
// KV cache layout (one sequence): element (position p, kv head g, dim d) of K and of V lives at
// kv_offset + (p * kv_heads + g) * head_dim + d, i.e. token-major rows of kv_heads*head_dim, so
// appending tokens and snapshotting a prefix are contiguous ranges. Query row t sits at absolute
// position q_pos + t and sees cache positions 0..=q_pos+t (the new rows are already in the cache).
// q head h uses kv head h / (heads / kv_heads). Output = softmax(scale * q.K) V * sigmoid(gate).
//
// Entry points:
// * attn_decode_split + attn_decode_reduce: flash-decoding for few query rows and a long cache.
//   Grid (splits, kv_heads, tokens); each workgroup scores split_len cache positions for all the
//   q heads sharing one kv head (K/V read once per group) and writes a partial output with its
//   running max and sum; the reduce pass (grid (heads, tokens)) merges the splits and gates.
// * attn_prefill: many query rows, tiled over 16 query rows x 8 cache positions, online softmax.

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
    _pad0: u32,
    _pad1: u32,
}

const WG: u32 = 64u;
// Decode: shared q of the heads of one group (group * head_dim <= MAX_GROUP_Q) and their scores
// (group * split_len <= MAX_SCORES).
// Both entry points share two workgroup arrays so a pipeline stays within WebGPU's default 16 KiB.
const MAX_GROUP: u32 = 16u;
const MAX_GROUP_Q: u32 = 2048u;
const MAX_SCORES: u32 = 1024u;
// Prefill tiles: BQ query rows x LANES invocations per row; each invocation owns head_dim / LANES
// dims (head_dim <= LANES * MAX_DIMS_PER_LANE); BK cache positions per tile.
const BQ: u32 = 16u;
const LANES: u32 = 4u;
const MAX_DIMS_PER_LANE: u32 = 64u;
const BK: u32 = 8u;
// Stands in for -inf: exp(MASKED - finite) is exactly 0 and it never produces a NaN.
const MASKED: f32 = -3.0e38;

@group(0) @binding(0) var<uniform> params: AttnParams;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> gate: array<f32>;
@group(0) @binding(3) var<storage, read> k_cache: array<f32>;
@group(0) @binding(4) var<storage, read> v_cache: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;
// Decode only: per (token, head, split) a head_dim partial output, and (max, sum) pairs.
@group(0) @binding(6) var<storage, read_write> partial_out: array<f32>;
@group(0) @binding(7) var<storage, read_write> partial_ml: array<f32>;

// Decode: the group's scaled queries; prefill: the current K or V tile (BK * head_dim).
var<workgroup> group_q: array<f32, MAX_GROUP_Q>;
// Decode: the group's scores; prefill: per-invocation partial dot products (WG * BK).
var<workgroup> scores: array<f32, MAX_SCORES>;
var<workgroup> group_max: array<f32, MAX_GROUP>;
var<workgroup> group_sum: array<f32, MAX_GROUP>;

fn q_index(t: u32, h: u32, d: u32) -> u32 {
    return params.q_offset + t * params.q_token_stride + h * params.q_head_stride + d;
}

fn gate_factor(t: u32, h: u32, d: u32) -> f32 {
    if params.gated == 0u {
        return 1.0;
    }
    let z = gate[params.gate_offset + t * params.gate_token_stride + h * params.gate_head_stride + d];
    return 1.0 / (1.0 + exp(-z));
}

fn kv_index(p: u32, g: u32, d: u32) -> u32 {
    return params.kv_offset + (p * params.kv_heads + g) * params.head_dim + d;
}

@compute @workgroup_size(WG)
fn attn_decode_split(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let split = wid.x;
    let kvh = wid.y;
    let t = wid.z;
    let hd = params.head_dim;
    let group = params.heads / params.kv_heads;
    let kv_len = params.q_pos + t + 1u;
    let start = split * params.split_len;
    let end = min(start + params.split_len, kv_len);
    let count = select(0u, end - start, end > start);

    for (var i = lid; i < group * hd; i += WG) {
        let g = i / hd;
        group_q[i] = q[q_index(t, kvh * group + g, i % hd)] * params.scale;
    }
    workgroupBarrier();
    for (var p = lid; p < count; p += WG) {
        for (var g = 0u; g < group; g++) {
            var acc = 0.0;
            for (var d = 0u; d < hd; d++) {
                acc += group_q[g * hd + d] * k_cache[kv_index(start + p, kvh, d)];
            }
            scores[g * params.split_len + p] = acc;
        }
    }
    workgroupBarrier();
    if lid < group {
        var m = MASKED;
        for (var p = 0u; p < count; p++) {
            m = max(m, scores[lid * params.split_len + p]);
        }
        var l = 0.0;
        for (var p = 0u; p < count; p++) {
            let e = exp(scores[lid * params.split_len + p] - m);
            scores[lid * params.split_len + p] = e;
            l += e;
        }
        group_max[lid] = m;
        group_sum[lid] = l;
    }
    workgroupBarrier();
    for (var d = lid; d < hd; d += WG) {
        var acc: array<f32, MAX_GROUP>;
        for (var g = 0u; g < group; g++) {
            acc[g] = 0.0;
        }
        for (var p = 0u; p < count; p++) {
            let v = v_cache[kv_index(start + p, kvh, d)];
            for (var g = 0u; g < group; g++) {
                acc[g] += scores[g * params.split_len + p] * v;
            }
        }
        for (var g = 0u; g < group; g++) {
            let slot = (t * params.heads + kvh * group + g) * params.splits + split;
            partial_out[slot * hd + d] = acc[g];
        }
    }
    if lid < group {
        let slot = (t * params.heads + kvh * group + lid) * params.splits + split;
        partial_ml[slot * 2u] = group_max[lid];
        partial_ml[slot * 2u + 1u] = group_sum[lid];
    }
}

@compute @workgroup_size(WG)
fn attn_decode_reduce(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let h = wid.x;
    let t = wid.y;
    let hd = params.head_dim;
    let first = (t * params.heads + h) * params.splits;
    var m = MASKED;
    for (var s = 0u; s < params.splits; s++) {
        m = max(m, partial_ml[(first + s) * 2u]);
    }
    var l = 0.0;
    for (var s = 0u; s < params.splits; s++) {
        l += partial_ml[(first + s) * 2u + 1u] * exp(partial_ml[(first + s) * 2u] - m);
    }
    for (var d = lid; d < hd; d += WG) {
        var acc = 0.0;
        for (var s = 0u; s < params.splits; s++) {
            acc += partial_out[(first + s) * hd + d] * exp(partial_ml[(first + s) * 2u] - m);
        }
        out[params.out_offset + t * params.out_token_stride + h * hd + d] = acc / l * gate_factor(t, h, d);
    }
}

@compute @workgroup_size(WG)
fn attn_prefill(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let h = wid.y;
    let hd = params.head_dim;
    let kvh = h / (params.heads / params.kv_heads);
    let row = lid / LANES;
    let lane = lid % LANES;
    let t = wid.x * BQ + row;
    let row_valid = t < params.tokens;
    let dims = (hd + LANES - 1u) / LANES;

    var q_reg: array<f32, MAX_DIMS_PER_LANE>;
    var o_reg: array<f32, MAX_DIMS_PER_LANE>;
    for (var i = 0u; i < dims; i++) {
        let d = lane + i * LANES;
        q_reg[i] = 0.0;
        o_reg[i] = 0.0;
        if row_valid && d < hd {
            q_reg[i] = q[q_index(t, h, d)] * params.scale;
        }
    }
    var m = MASKED;
    var l = 0.0;
    // Every row of this workgroup needs positions up to q_pos + last row (uniform across it).
    let last_row = min(wid.x * BQ + BQ, params.tokens) - 1u;
    let kv_end = params.q_pos + last_row + 1u;
    let my_end = params.q_pos + t + 1u;
    let tile_len = BK * hd;
    for (var p0 = 0u; p0 < kv_end; p0 += BK) {
        for (var i = lid; i < tile_len; i += WG) {
            let p = p0 + i / hd;
            group_q[i] = select(0.0, k_cache[kv_index(p, kvh, i % hd)], p < kv_end);
        }
        workgroupBarrier();
        for (var j = 0u; j < BK; j++) {
            var acc = 0.0;
            for (var i = 0u; i < dims; i++) {
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
            // Masked entries give exactly 0 even when m_new is still MASKED.
            let e = select(exp(p_row[j] - m_new), 0.0, p_row[j] == MASKED);
            p_row[j] = e;
            l += e;
        }
        m = m_new;
        workgroupBarrier();
        for (var i = lid; i < tile_len; i += WG) {
            let p = p0 + i / hd;
            group_q[i] = select(0.0, v_cache[kv_index(p, kvh, i % hd)], p < kv_end);
        }
        workgroupBarrier();
        for (var i = 0u; i < dims; i++) {
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
        for (var i = 0u; i < dims; i++) {
            let d = lane + i * LANES;
            if d < hd {
                out[params.out_offset + t * params.out_token_stride + h * hd + d] = o_reg[i] / l * gate_factor(t, h, d);
            }
        }
    }
}
