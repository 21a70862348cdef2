// MoE router on the GPU (docs/numerics.md "MoE routing" steps 1-3): per token, softmax over the expert logits,
// top-k by probability (ties to the lowest expert id), weights renormalised by their sum clamped to
// >= 6.1e-5 (llama.cpp's clamp). Writes u32 expert ids and f32 weights for the id-indexed expert
// mat-vec. One workgroup per token.
#include "common.wgsl"
#include "common_reduce.wgsl"
#define WG 64

struct RouterParams {
    tokens: u32,
    experts: u32,
    k: u32,
    logits_offset: u32,
    logits_token_stride: u32,
}

const MAX_EXPERTS: u32 = 1024u;
const MAX_K: u32 = 32u;
const NO_EXPERT: u32 = 0xffffffffu;
// Below every probability: marks an expert already chosen.
const TAKEN: f32 = -1.0;
const MIN_WEIGHT_SUM: f32 = 6.1e-5;

var<immediate> P: RouterParams;
@group(0) @binding(0) var<storage, read> LOGITS: array<f32>;
@group(0) @binding(1) var<storage, read_write> EXPERT_IDS: array<u32>;
@group(0) @binding(2) var<storage, read_write> EXPERT_WEIGHTS: array<f32>;

var<workgroup> probs: array<f32, MAX_EXPERTS>;
var<workgroup> red_value: array<f32, {{WG}}>;
var<workgroup> red_id: array<u32, {{WG}}>;
var<workgroup> chosen_id: array<u32, MAX_K>;
var<workgroup> chosen_p: array<f32, MAX_K>;

fn better(av: f32, ai: u32, bv: f32, bi: u32) -> bool {
    return av > bv || (av == bv && ai < bi);
}

@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
    let lid = ids.lid;
    let token = group_index(ids);
    if token >= P.tokens {
        return;
    }
    let e_count = P.experts;
    let base = P.logits_offset + token * P.logits_token_stride;
    var local_max = -3.0e38;
    for (var e = lid; e < e_count; e += {{WG}}u) {
        let l = LOGITS[base + e];
        probs[e] = l;
        local_max = max(local_max, l);
    }
    let m = wg_max(local_max, ids);
    var local_sum = 0.0;
    for (var e = lid; e < e_count; e += {{WG}}u) {
        let x = exp(probs[e] - m);
        probs[e] = x;
        local_sum += x;
    }
    let total = wg_sum(local_sum, ids);
    for (var e = lid; e < e_count; e += {{WG}}u) {
        probs[e] = probs[e] / total;
    }
    workgroupBarrier();

    for (var it = 0u; it < P.k; it++) {
        var best_value = TAKEN;
        var best_id = NO_EXPERT;
        // Ascending scan with a strict comparison keeps the lowest id among equal probabilities.
        for (var e = lid; e < e_count; e += {{WG}}u) {
            if probs[e] > best_value {
                best_value = probs[e];
                best_id = e;
            }
        }
        red_value[lid] = best_value;
        red_id[lid] = best_id;
        workgroupBarrier();
        for (var width = {{WG}}u / 2u; width > 0u; width /= 2u) {
            if lid < width && better(red_value[lid + width], red_id[lid + width], red_value[lid], red_id[lid]) {
                red_value[lid] = red_value[lid + width];
                red_id[lid] = red_id[lid + width];
            }
            workgroupBarrier();
        }
        if lid == 0u {
            chosen_id[it] = red_id[0];
            chosen_p[it] = red_value[0];
            probs[red_id[0]] = TAKEN;
        }
        workgroupBarrier();
    }
    if lid == 0u {
        var sum = 0.0;
        for (var it = 0u; it < P.k; it++) {
            sum += chosen_p[it];
        }
        sum = max(sum, MIN_WEIGHT_SUM);
        for (var it = 0u; it < P.k; it++) {
            EXPERT_IDS[token * P.k + it] = chosen_id[it];
            EXPERT_WEIGHTS[token * P.k + it] = chosen_p[it] / sum;
        }
    }
}
