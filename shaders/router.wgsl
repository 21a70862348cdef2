// MoE router on the GPU (docs/numerics.md "MoE routing" steps 1-3): per token, softmax over the
// expert logits, top-k by probability (ties to the lowest expert id), weights renormalised by their
// sum clamped to >= 6.1e-5 (llama.cpp's clamp). Writes u32 expert ids and f32 weights for the
// id-indexed expert mat-vec. One workgroup per token.
//
// SG > 0 is the fast path for a device whose subgroups have exactly SG lanes: the workgroup is one
// subgroup routing with common_route.wgsl (each lane keeps its experts' probabilities in registers,
// each of the k picks is two subgroup reductions with no barrier (the shared-memory tree below costs ~6 barriers per pick: the
// router was 23 µs of a decode step's layer on the H200). With SHARED=1 the token's shared expert
// becomes pick k: id P.shared_id (its rows appended to the expert tensors), weight sigmoid of its gate
// logit, so the expert kernels and the combine treat it like a routed one.
#include "common.wgsl"
#include "common_reduce.wgsl"
#if SG
#include "common_route.wgsl"
#endif
#define WG 64
#define SG 0
#define SHARED 0
// SG path: experts per lane, ceil(experts / SG).
#define PER_LANE 16
// The routing library's subgroup size (the SG path's).
#define RSG 32
#variants SHARED=1
#variants SG=32 RSG=32 WG=32 SHARED=1 SUBGROUPS=1
#variants SG=8 RSG=8 WG=8 PER_LANE=64 SUBGROUPS=1

// The immediates, declared with their field docs in rust/ops/router.rs (RouterImmediates).
#params RouterImmediates

const MAX_EXPERTS: u32 = 1024u;
const MAX_K: u32 = 32u;

var<immediate> P: RouterImmediates;
@group(0) @binding(0) var<storage, read> ROUTE_LOGITS: array<f32>;
@group(0) @binding(1) var<storage, read_write> ROUTE_IDS: array<u32>;
@group(0) @binding(2) var<storage, read_write> ROUTE_W: array<f32>;
#if SHARED
@group(0) @binding(3) var<storage, read> GATE: array<f32>;
#endif

#if SG
@compute @workgroup_size({{SG}})
fn main(ids: ComputeIds) {
    let lane = ids.lid;
    let token = group_index(ids);
    if token >= P.tokens {
        return;
    }
    let out = token * P.ids_stride;
    let args = RouteArgs(P.logits_offset + token * P.logits_token_stride, P.experts, P.k, false, 0u, 0u, out, true, 0u);
    route_token(lane, args);
#if SHARED
    if lane == 0u {
        ROUTE_IDS[out + P.k] = P.shared_id;
        ROUTE_W[out + P.k] = 1.0 / (1.0 + exp(-GATE[P.gate_offset + token * P.gate_stride]));
    }
#endif
}
#else
const NO_EXPERT: u32 = 0xffffffffu;
// Below every probability: marks an expert already chosen.
const TAKEN: f32 = -1.0;
const MIN_WEIGHT_SUM: f32 = 6.1e-5;

var<workgroup> chosen_id: array<u32, MAX_K>;
var<workgroup> chosen_p: array<f32, MAX_K>;

fn better(av: f32, ai: u32, bv: f32, bi: u32) -> bool {
    return av > bv || (av == bv && ai < bi);
}

// Invocation 0 writes the token's picks (chosen_*), renormalised, and the shared slot.
fn write_token(token: u32) {
    var sum = 0.0;
    for (var it = 0u; it < P.k; it++) {
        sum += chosen_p[it];
    }
    sum = max(sum, MIN_WEIGHT_SUM);
    let base = token * P.ids_stride;
    for (var it = 0u; it < P.k; it++) {
        ROUTE_IDS[base + it] = chosen_id[it];
        ROUTE_W[base + it] = chosen_p[it] / sum;
    }
#if SHARED
    ROUTE_IDS[base + P.k] = P.shared_id;
    ROUTE_W[base + P.k] = 1.0 / (1.0 + exp(-GATE[P.gate_offset + token * P.gate_stride]));
#endif
}

var<workgroup> probs: array<f32, MAX_EXPERTS>;
var<workgroup> red_value: array<f32, {{WG}}>;
var<workgroup> red_id: array<u32, {{WG}}>;

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
        let l = ROUTE_LOGITS[base + e];
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
        write_token(token);
    }
}
#endif
