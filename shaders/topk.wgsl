// Top-k (k <= 256, k = 1 is argmax) over a full vocabulary of f32 logits, ties to the lowest id,
// writing (id, logit) pairs in descending order. Two passes: topk_block finds the top k of each
// block of block_len logits (grid = blocks), topk_merge (one workgroup) the top k of those
// candidates. Several rows (grid z = row) run in the same two dispatches: row r reads logits from
// offset + r * row_stride and writes its k pairs at r * k. Each invocation owns a strided subset of its entries and caches the best one not yet
// taken; since entries are taken in strictly decreasing (logit desc, id asc) order, "not yet taken"
// is "ordered after the last one this invocation gave", so nothing has to be marked.
#include "common.wgsl"
#define WG 256
#define OP block
#variants OP=merge

struct Pair {
    id: u32,
    logit: f32,
}

// The immediates, declared with their field docs in rust/ops/topk.rs (TopkParams).
#params TopkParams

const NONE: u32 = 0xffffffffu;
const LOWEST: f32 = -3.4028235e38;

var<immediate> P: TopkParams;
#if OP == block
@group(0) @binding(0) var<storage, read> LOGITS: array<f32>;
@group(0) @binding(1) var<storage, read_write> CANDIDATES: array<Pair>;
#else
@group(0) @binding(0) var<storage, read> CANDIDATES: array<Pair>;
@group(0) @binding(1) var<storage, read_write> RESULT: array<Pair>;
#endif

// This workgroup's row: where its logits start, and where its candidates start.
var<private> logits_base: u32;
var<private> candidates_base: u32;

var<workgroup> red_id: array<u32, {{WG}}>;
var<workgroup> red_logit: array<f32, {{WG}}>;

// a comes strictly before b in (logit desc, id asc); a real entry always beats NONE.
fn before(a: Pair, b: Pair) -> bool {
    if b.id == NONE {
        return a.id != NONE;
    }
    if a.id == NONE {
        return false;
    }
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
}

// NaN would break the total order; it sorts last.
fn sanitize(x: f32) -> f32 {
    return select(LOWEST, x, x == x);
}

fn workgroup_best(lid: u32, mine: Pair) -> Pair {
    red_id[lid] = mine.id;
    red_logit[lid] = mine.logit;
    workgroupBarrier();
    for (var width = {{WG}}u / 2u; width > 0u; width /= 2u) {
        if lid < width {
            let other = Pair(red_id[lid + width], red_logit[lid + width]);
            if before(other, Pair(red_id[lid], red_logit[lid])) {
                red_id[lid] = other.id;
                red_logit[lid] = other.logit;
            }
        }
        workgroupBarrier();
    }
    let best = Pair(red_id[0], red_logit[0]);
    workgroupBarrier();
    return best;
}

#if OP == block
fn block_scan(lid: u32, start: u32, end: u32, has_last: bool, last: Pair) -> Pair {
    var best = Pair(NONE, LOWEST);
    for (var i = start + lid; i < end; i += {{WG}}u) {
        let entry = Pair(i, sanitize(LOGITS[logits_base + i]));
        if (!has_last || before(last, entry)) && before(entry, best) {
            best = entry;
        }
    }
    return best;
}

#endif

#if OP == merge
fn merge_scan(lid: u32, count: u32, has_last: bool, last: Pair) -> Pair {
    var best = Pair(NONE, LOWEST);
    for (var i = lid; i < count; i += {{WG}}u) {
        let entry = CANDIDATES[candidates_base + i];
        if (!has_last || before(last, entry)) && before(entry, best) {
            best = entry;
        }
    }
    return best;
}

#endif

#if OP == block
@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
    let lid = ids.lid;
    let b = group_index(ids);
    logits_base = P.offset + ids.wid.z * P.row_stride;
    candidates_base = ids.wid.z * P.blocks * P.k;
    let start = b * P.block_len;
    let end = min(start + P.block_len, P.n);
    var last = Pair(NONE, LOWEST);
    var has_last = false;
    var mine = block_scan(lid, start, end, has_last, last);
    for (var it = 0u; it < P.k; it++) {
        let best = workgroup_best(lid, mine);
        if lid == 0u {
            CANDIDATES[candidates_base + b * P.k + it] = best;
        }
        if best.id != NONE && best.id == mine.id {
            last = mine;
            has_last = true;
            mine = block_scan(lid, start, end, has_last, last);
        }
    }
}

#endif

#if OP == merge
@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
    let lid = ids.lid;
    let count = P.blocks * P.k;
    candidates_base = ids.wid.z * count;
    var last = Pair(NONE, LOWEST);
    var has_last = false;
    var mine = merge_scan(lid, count, has_last, last);
    for (var it = 0u; it < P.k; it++) {
        let best = workgroup_best(lid, mine);
        if lid == 0u {
            RESULT[ids.wid.z * P.k + it] = best;
        }
        if best.id != NONE && best.id == mine.id {
            last = mine;
            has_last = true;
            mine = merge_scan(lid, count, has_last, last);
        }
    }
}
#endif
