// MoE routing of one token by one subgroup (docs/numerics.md "MoE routing"): softmax over the expert
// logits, the top k by probability (ties to the lowest id), weights renormalised by their sum clamped
// to >= 6.1e-5, and optionally the shared expert as pick k weighted by sigmoid of its gate logit.
// Every lane of the subgroup calls route_token with the same arguments (subgroup-uniform); a lane
// holds experts lane + j·RSG for j < PER_LANE in registers, and each pick is two subgroup
// reductions, no barrier. Several subgroups of a workgroup may route the same token: they compute
// the same picks in the same order.
//
// The including kernel declares ROUTE_LOGITS (array<f32>), ROUTE_IDS (array<u32>, read_write) and
// ROUTE_W (array<f32>, read_write), and defines RSG (its subgroup size) and PER_LANE
// (ceil(experts / RSG)).
//
// The picks compare integer keys, not floats: a probability is >= 0, so its float bits order as
// a u32 does; the key is those bits + 1, and 0 marks a taken expert (or a NaN, which no float
// comparison ever picked). The same picks as comparing the floats; each round's reductions are
// 32-bit integer max and min, which a GPU may do in one instruction where an f32 max takes
// shuffle steps (on the H200 the routed gate/up measured 17.6 → 16.7 µs at one token, 2026-12-02).

const ROUTE_NO_EXPERT: u32 = 0xffffffffu;
// What a round reports when no expert is left (all taken): the float compare's "below every
// probability".
const ROUTE_TAKEN: f32 = -1.0;
// The key of a taken expert: below every probability's.
const ROUTE_KEY_TAKEN: u32 = 0u;
const ROUTE_MIN_WEIGHT_SUM: f32 = 6.1e-5;

struct RouteArgs {
    // Logits of the token at ROUTE_LOGITS[logits + e] for e < experts; pick k of them.
    logits: u32,
    experts: u32,
    k: u32,
    // With `with_shared`, the shared expert's id (pick k) and its gate logit at ROUTE_LOGITS[gate].
    with_shared: bool,
    shared_id: u32,
    gate: u32,
    // Where the picks go (k or k + 1 ids and weights from this index), if `write`.
    out: u32,
    write: bool,
    // The pick whose id route_token returns (ROUTE_NO_EXPERT when there is no such pick).
    want: u32,
}

fn route_token(lane: u32, a: RouteArgs) -> u32 {
    var probs: array<f32, {{PER_LANE}}>;
    var local_max = -3.0e38;
#for j in 0..PER_LANE
    probs[{{j}}] = ROUTE_TAKEN;
    if lane + {{j}}u * {{RSG}}u < a.experts {
        probs[{{j}}] = ROUTE_LOGITS[a.logits + lane + {{j}}u * {{RSG}}u];
        local_max = max(local_max, probs[{{j}}]);
    }
#endfor
    let m = subgroupMax(local_max);
    var local_sum = 0.0;
#for j in 0..PER_LANE
    if lane + {{j}}u * {{RSG}}u < a.experts {
        probs[{{j}}] = exp(probs[{{j}}] - m);
        local_sum += probs[{{j}}];
    }
#endfor
    let total = subgroupAdd(local_sum);
#for j in 0..PER_LANE
    if lane + {{j}}u * {{RSG}}u < a.experts {
        probs[{{j}}] = probs[{{j}}] / total;
    }
#endfor
    var keys: array<u32, {{PER_LANE}}>;
#for j in 0..PER_LANE
    keys[{{j}}] = select(ROUTE_KEY_TAKEN, bitcast<u32>(probs[{{j}}]) + 1u,
        lane + {{j}}u * {{RSG}}u < a.experts && probs[{{j}}] >= 0.0);
#endfor
    var wanted = ROUTE_NO_EXPERT;
    var sum = 0.0;
    let writer = a.write && lane == 0u;
    // A subgroup that writes no picks stops at the one it wants; the shared expert (pick k) and a
    // pick past the end need no round.
    let rounds = select(select(a.want + 1u, 0u, a.want >= a.k), a.k, a.write);
    for (var it = 0u; it < rounds; it++) {
        // Within a lane experts ascend with j, so the strict comparison keeps the lowest id.
        var best_key = ROUTE_KEY_TAKEN;
        var best_id = ROUTE_NO_EXPERT;
#for j in 0..PER_LANE
        if keys[{{j}}] > best_key {
            best_key = keys[{{j}}];
            best_id = lane + {{j}}u * {{RSG}}u;
        }
#endfor
        let top_key = subgroupMax(best_key);
        let winner = subgroupMin(select(ROUTE_NO_EXPERT, best_id, best_key == top_key && top_key != ROUTE_KEY_TAKEN));
        let top = select(bitcast<f32>(top_key - 1u), ROUTE_TAKEN, top_key == ROUTE_KEY_TAKEN);
#for j in 0..PER_LANE
        if winner == lane + {{j}}u * {{RSG}}u {
            keys[{{j}}] = ROUTE_KEY_TAKEN;
        }
#endfor
        sum += top;
        if it == a.want {
            wanted = winner;
        }
        if writer {
            // Raw probabilities first; renormalised below, by this invocation (program order).
            ROUTE_IDS[a.out + it] = winner;
            ROUTE_W[a.out + it] = top;
        }
    }
    if writer {
        let norm = max(sum, ROUTE_MIN_WEIGHT_SUM);
        for (var it = 0u; it < a.k; it++) {
            ROUTE_W[a.out + it] = ROUTE_W[a.out + it] / norm;
        }
        if a.with_shared {
            ROUTE_IDS[a.out + a.k] = a.shared_id;
            ROUTE_W[a.out + a.k] = 1.0 / (1.0 + exp(-ROUTE_LOGITS[a.gate]));
        }
    }
    if a.with_shared && a.want == a.k {
        wanted = a.shared_id;
    }
    return wanted;
}
