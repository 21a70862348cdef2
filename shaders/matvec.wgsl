// Mat-vec for decode: Y[:, c] = W · X[:, c] for NC activation columns (1..8) that share one read of
// the weights, W in any ggml type (dequantised on the fly), X and Y f32. A workgroup computes NR
// consecutive rows; its WG invocations stride over K, then reduce across the workgroup. CG > 1
// (dense only) splits a dispatch's CG · NC columns into groups of NC, one group per workgroup: fewer
// activation registers per invocation for the weights read once per group (L2 after the first).
// IQ4_XS, Q8_0, Q4_K and Q6_K (the bulk of a model's weights) have their own steps: neighbouring
// invocations read neighbouring words (coalesced), every nibble of a word is decoded (IQ4 values
// looked up in workgroup memory or, KV_SHUFFLE=1, by subgroup shuffles), block scales apply once per
// dot product, ints become floats by exact float-bit tricks instead of quarter-rate conversions, and
// UNROLL steps' loads are issued before their arithmetic: the 4-bit decoders were bound by
// instructions per byte on the H200.
// Every other type goes 8 weights at a time through common_dequant. With MOE=1 the grid is
// (row groups, n_used, tokens) and each workgroup reads its expert id from IDS (no CPU round
// trip) and skips experts outside this window.
//
// Fused input and output stages (the decode step's way of saving a dispatch per norm and per
// residual add; every activation read goes through x_at):
// * PRE=rms: each column is RMS-normalised on the fly, x * (NORM * 1/sqrt(mean(x^2) + eps)); every
//   workgroup sums the squares of its columns itself instead of waiting on a norm kernel. The scale
//   is a per-column constant, so it applies to the finished dot products: the squares are summed
//   from the very activation loads the products make (every K step is read once per workgroup) and
//   reduced with them, so the weight loads start at once instead of after a pass over X and a
//   workgroup reduction. XN_STORE=1: the workgroups also write the normalised columns to XN
//   (packed, K floats each, for the kernels that read them next), each its slice, once its sums
//   are reduced.
// * PRE=head_rms: the RMS norm of each HD4 · 4-float head of a column finished from sums of squares
//   computed upstream (shaders/gdn_step.wgsl): head h of column c is scaled by 1/sqrt(Σ_g
//   SQ[sq_offset + c · sq_stride + h · head_parts + g] / (4 · HD4) + eps), g < head_parts. The
//   HEADS · NC scales are computed once per workgroup into workgroup memory.
// * PRE=silu_mul: a column is a gate ‖ up pair (the expert's gate_up output), read as
//   silu(gate) * up with up P.pre_offset floats after gate: the MoE down projection's input.
// * EPI=add: Y = RES + W·x (RES laid out like Y): the residual stream update.
// * EPI=accumulate: Y += W·x, in place (the MoE's weighted sum into the residual stream, SUM=1).
// * EPI=conv: rows below P.conv_rows are a GDN channel's pre-conv input, so the causal conv1d
//   (P.taps taps, CONV_W[ch * taps + j], tap taps-1 the current input) and SiLU run here and the
//   slot's conv state (STATE[SLOTS[c] * state_stride + j * conv_rows + ch], oldest first) advances;
//   each channel has one owner, so the update needs no synchronisation. Rows above are stored as is.
// * EXTRA=1 (dense, EPI=store or conv): the first ceil(P.extra_rows / NR) workgroups compute
//   P.extra_rows more rows from W2 (F32, K floats per row from vec4 P.extra_offset) on the same
//   input, stored as is after the matrix's rows (Y row P.rows + i); the matrix's own come after
//   them. The decode step's F32 beta/alpha projection rides in the q‖k‖v‖z dispatch; its
//   workgroups walk all of K in F32 and take longest, so they are launched first rather than
//   last, where at several columns they were the dispatch's tail.
// Extra bindings follow W, X, Y in the order IDS, NORM or SQ, XN, RES, CONV_W, STATE, SLOTS, W2
// (those the mode uses); their numbers come from the B_* defines the host computes.
#include "common.wgsl"
#include "common_dequant.wgsl"
#include "common_reduce.wgsl"
#if ROUTE
#include "common_route.wgsl"
#endif
#if PRE == head_rms
#include "common_head_rms.wgsl"
#endif
#include "common_epilogue.wgsl"
#define QTYPE q8_0
#define NC 1
// Dense only: the dispatch's columns in CG groups of NC, one group per workgroup.
#define CG 1
#define NR 2
#define ACC4 1
#define WG 64
#define MOE 0
#define PRE none
#define XN_STORE 0
#define EPI store
// Columns of the PRE=rms sums, packed four to a vec4: ceil(NC / 4).
#define NC4 1
#define B_IDS 3
#define B_NORM 3
#define B_SQ 3
// PRE=head_rms: vec4s per head and heads per column.
#define HD4 32
#define HEADS 32
#define B_XN 4
#define B_RES 3
#define B_CW 3
#define B_ST 4
#define B_SL 5
#define EXTRA 0
#define B_W2 3
// MOE with ROUTE=1: the token's experts are picked here from the router logits (common_route.wgsl:
// subgroup 0 of each workgroup routes, RSG its size, PER_LANE = ceil(experts / RSG)) instead of by a
// router dispatch, and one workgroup per token writes the picks for the kernels after it.
#define ROUTE 0
// MOE with SUM=1 (decode's expert down projection): one workgroup row group per token sums every
// pick's product weighted by its routing weight (SUM_W, laid out like IDS), so the MoE's weighted
// sum needs no kernel of its own; EPI=accumulate adds the sum to Y (the residual stream).
#define SUM 0
#define B_SW 4
#define RSG 32
#define PER_LANE 16
#define B_RW 4
#define B_RL 5
// Steps per loop iteration of the word paths (loads of all issued first); 1 for many columns,
// whose activation registers would otherwise crowd out occupancy.
#define UNROLL 2
// IQ4_XS values from subgroup shuffles instead of a workgroup table (host: Iq4Lookup).
#define KV_SHUFFLE 0
// The device's smallest subgroup size (the host's; sizes the epilogue's exchange).
#define SG_MIN 4
#variants QTYPE=f32
#variants QTYPE=f16 NC=4 ACC4=2
#variants QTYPE=bf16
#variants QTYPE=q4_0
#variants QTYPE=q4_k NC=8 NR=4 ACC4=8
#variants QTYPE=q5_k
#variants QTYPE=q6_k NC=2
#variants QTYPE=iq4_nl
#variants QTYPE=iq4_xs MOE=1 NR=16 WG=32 ACC4=4
#variants QTYPE=iq4_xs WG=128 NR=4 ACC4=2
#variants QTYPE=iq4_xs NC=8 NR=2 ACC4=4 UNROLL=1
#variants QTYPE=q8_0 NC=3 NR=2 ACC4=2 MOE=1
#variants QTYPE=q4_1
#variants QTYPE=q5_0
#variants QTYPE=q5_1
#variants QTYPE=q2_k
#variants QTYPE=q3_k
#variants QTYPE=iq1_s
#variants QTYPE=iq1_m
#variants QTYPE=iq2_xxs
#variants QTYPE=iq2_xs
#variants QTYPE=iq2_s
#variants QTYPE=iq3_xxs
#variants QTYPE=iq3_s
#variants QTYPE=mxfp4
#variants QTYPE=iq4_xs NR=8 WG=32 ACC4=2 PRE=rms
#variants QTYPE=f32 NC=6 NR=2 ACC4=3 NC4=2 PRE=rms XN_STORE=1 B_NORM=3 B_XN=4
#variants QTYPE=f32 NC=3 CG=2 NR=2 ACC4=2 PRE=rms XN_STORE=1 B_NORM=3 B_XN=4
#variants QTYPE=q4_k NC=2 PRE=rms EPI=conv B_NORM=3 B_CW=4 B_ST=5 B_SL=6
#variants QTYPE=iq4_xs NR=8 WG=64 ACC4=2 PRE=rms EPI=conv B_NORM=3 B_CW=4 B_ST=5 B_SL=6 EXTRA=1 B_W2=7
#variants QTYPE=iq4_xs NC=4 CG=2 NR=8 WG=64 ACC4=8 PRE=rms EPI=conv B_NORM=3 B_CW=4 B_ST=5 B_SL=6 EXTRA=1 B_W2=7
#variants QTYPE=iq4_xs NR=8 WG=32 ACC4=2 EPI=add B_RES=3
#variants QTYPE=iq4_xs NR=4 WG=256 PRE=head_rms EPI=add B_SQ=3 B_RES=4
#variants QTYPE=q6_k MOE=1 PRE=silu_mul B_IDS=3
#variants QTYPE=iq4_xs MOE=1 SUM=1 PRE=silu_mul EPI=accumulate NR=16 WG=128 ACC4=4
#variants QTYPE=q8_0 MOE=1 SUM=1 PRE=silu_mul EPI=accumulate NR=4 WG=64
#variants QTYPE=q4_k MOE=1 SUM=1 EPI=accumulate
#variants QTYPE=q6_k MOE=1 SUM=1 PRE=silu_mul EPI=accumulate UNROLL=1
#variants QTYPE=q5_k MOE=1 SUM=1 PRE=silu_mul EPI=accumulate
#variants QTYPE=iq4_xs MOE=1 ROUTE=1 RSG=32 PER_LANE=16 WG=128 NR=1 SUBGROUPS=1
#variants QTYPE=iq4_xs MOE=1 ROUTE=1 RSG=32 PER_LANE=16 WG=128 NR=1 SUBGROUPS=1 KV_SHUFFLE=1
#variants QTYPE=iq4_xs MOE=1 SUM=1 PRE=silu_mul EPI=accumulate NR=8 WG=128 ACC4=2 SUBGROUPS=1 KV_SHUFFLE=1
#variants QTYPE=q8_0 MOE=1 ROUTE=1 RSG=8 PER_LANE=9 SUBGROUPS=1

// The immediates, declared with their field docs in rust/ops/matmul.rs (MatvecParams).
#params MatvecParams

var<immediate> P: MatvecParams;
@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
#if MOE
#if ROUTE
@group(0) @binding({{B_IDS}}) var<storage, read_write> ROUTE_IDS: array<u32>;
@group(0) @binding({{B_RW}}) var<storage, read_write> ROUTE_W: array<f32>;
@group(0) @binding({{B_RL}}) var<storage, read> ROUTE_LOGITS: array<f32>;
#else
@group(0) @binding({{B_IDS}}) var<storage, read> IDS: array<u32>;
#endif
#if SUM
@group(0) @binding({{B_SW}}) var<storage, read> SUM_W: array<f32>;
var<private> sum_picks_at: u32;
#endif

var<workgroup> moe_expert: u32;
#endif
#if PRE == rms
@group(0) @binding({{B_NORM}}) var<storage, read> NORM: array<vec4<f32>>;
#endif
#if PRE == head_rms
@group(0) @binding({{B_SQ}}) var<storage, read> SQ: array<f32>;
var<workgroup> head_inv: array<f32, {{NC}} * {{HEADS}}>;
#endif
#if XN_STORE
@group(0) @binding({{B_XN}}) var<storage, read_write> XN: array<vec4<f32>>;
#endif
#if EPI == add
@group(0) @binding({{B_RES}}) var<storage, read> RES: array<f32>;
#endif
#if EXTRA
@group(0) @binding({{B_W2}}) var<storage, read> W2: array<vec4<f32>>;
#endif
#if EPI == conv
@group(0) @binding({{B_CW}}) var<storage, read> CONV_W: array<f32>;
@group(0) @binding({{B_ST}}) var<storage, read_write> STATE: array<f32>;
@group(0) @binding({{B_SL}}) var<storage, read> SLOTS: array<u32>;
#endif

// Where this workgroup's activation columns start (vec4 index) and how far apart they are.
var<private> x_base: u32;
var<private> x_col: u32;
// PRE=rms defers the norm's scale to the epilogue: its NC4 vec4 of sums of squares are reduced with
// the products.
#if PRE == rms
const SQ4 = {{NC4}}u;
#else
const SQ4 = 0u;
#endif
// The epilogue's exchange: per subgroup, ACC4 vec4 of products, then SQ4 of sums of squares; at
// most WG / SG_MIN subgroups (SG_MIN: the device's smallest subgroup size).
const RED_VEC4 = {{ACC4}}u + SQ4;
#if SUBGROUPS
var<workgroup> red_scratch: array<vec4<f32>, RED_VEC4 * (({{WG}}u + {{SG_MIN}}u - 1u) / {{SG_MIN}}u)>;
#else
var<workgroup> red_scratch: array<vec4<f32>, RED_VEC4>;
#endif
#if PRE == rms
// The columns' sums of squares so far, four to a vec4, and whether the step being loaded counts
// (0 for the clamped re-read past the end of K).
var<private> sq_part: array<vec4<f32>, {{NC4}}>;
var<private> sq_live: f32 = 1.0;
#endif

// One step of the K loops: with SUM, the loops walk the token's picks' rows end to end (picks × K),
// and virtual step v is step v % per_pick of pick v / per_pick, whose expert's rows sit w_byte
// further in W and whose activation column x_vec vec4s further in X, weighted by its routing
// weight. An id outside this window gets weight 0 (its step reads the window's first expert).
// Otherwise the identity.
struct PickStep {
    step: u32,
    w_byte: u32,
    x_vec: u32,
    weight: f32,
}

fn pick_step(v: u32, per_pick: u32) -> PickStep {
#if SUM
    let slot = v / per_pick;
    let e = IDS[sum_picks_at + slot];
    let here = e >= P.expert_first && e < P.expert_first + P.expert_count;
    return PickStep(v % per_pick, select(0u, (e - P.expert_first) * P.rows * P.row_bytes, here),
        slot * P.x_col_slot * (P.x_stride / 4u), select(0.0, SUM_W[sum_picks_at + slot], here));
#else
    return PickStep(v, 0u, 0u, 1.0);
#endif
}

// Whether the activation loads that follow count towards PRE=rms's sums of squares.
fn set_sq_live(live: bool) {
#if PRE == rms
    sq_live = select(0.0, 1.0, live);
#endif
}

// This invocation's part of a workgroup sum: its subgroup's sum, or (without subgroups) the whole
// workgroup's by wg_sum4 (uniform control flow only).
fn part_sum4(v: vec4<f32>, ids: ComputeIds) -> vec4<f32> {
#if SUBGROUPS
    return subgroupAdd(v);
#else
    return wg_sum4(v, ids);
#endif
}

// Component j of vec4 a of the workgroup's sums (red_scratch), over its n_sg subgroups in order.
fn workgroup_sum(a: u32, j: u32, n_sg: u32) -> f32 {
    var t = red_scratch[a][j];
    for (var g = 1u; g < n_sg; g++) {
        t += red_scratch[g * RED_VEC4 + a][j];
    }
    return t;
}

// What column c's finished products are scaled by: PRE=rms applies the norm's scale
// 1/sqrt(mean(x^2) + eps) here (x_at left it out), from the sums of squares the epilogue reduced;
// everything else has nothing left to apply (1, exact).
fn column_scale(c: u32, n_sg: u32) -> f32 {
    var scale = 1.0;
#if PRE == rms
    scale = inverseSqrt(workgroup_sum({{ACC4}}u + c / 4u, c % 4u, n_sg) / f32(P.k) + P.eps);
#endif
    return scale;
}

// Activation column c at vec4 index v from its start, after the PRE stage (PRE=rms: before the
// column's scale, which the caller applies to the finished products).
fn x_at(c: u32, v: u32) -> vec4<f32> {
#if PRE == rms
    let xv = X[x_base + c * x_col + v];
    sq_part[c / 4u][c % 4u] += sq_live * dot(xv, xv);
    return xv * NORM[v];
#else
#if PRE == head_rms
    return X[x_base + c * x_col + v] * head_inv[c * {{HEADS}}u + v / {{HD4}}u];
#else
#if PRE == silu_mul
    let g = X[x_base + c * x_col + v];
    let u = X[x_base + c * x_col + v + P.pre_offset / 4u];
    return g / (vec4<f32>(1.0) + exp(-g)) * u;
#else
    return X[x_base + c * x_col + v];
#endif
#endif
#endif
}

#if QTYPE == iq4_xs
#if KV_SHUFFLE
// kvalues_iq4nl[lane % 16] in a register of every lane: a value is a subgroup shuffle from the lane
// its nibble names (subgroups of at least 16 lanes, every lane active at each lookup), so a
// workgroup starts its weight loads without filling a table and waiting at a barrier.
var<private> kv_lane: f32;

fn kv4(n: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(subgroupShuffle(kv_lane, n.x), subgroupShuffle(kv_lane, n.y), subgroupShuffle(kv_lane, n.z), subgroupShuffle(kv_lane, n.w));
}
#else
// kvalues_iq4nl as floats: a 16-entry table in workgroup memory is one shared load per weight (no
// bank conflicts: distinct entries sit in distinct banks), fewer instructions than select chains.
var<workgroup> kv_table: array<f32, 16>;

fn kv4(n: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(kv_table[n.x], kv_table[n.y], kv_table[n.z], kv_table[n.w]);
}
#endif

// The IQ4 values of the low (high) nibbles of the four bytes of q.
fn kv_word_lo(q: u32) -> vec4<f32> {
    return kv4((vec4<u32>(q) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(15u));
}

fn kv_word_hi(q: u32) -> vec4<f32> {
    return kv4((vec4<u32>(q) >> vec4<u32>(4u, 12u, 20u, 28u)) & vec4<u32>(15u));
}
#endif

// The low nibbles of the four bytes of w as floats (2^23 + n as float bits, minus 2^23: exact,
// no int-to-float conversion).
fn nib4_f32(w: u32) -> vec4<f32> {
    let n = (vec4<u32>(w) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(15u);
    return bitcast<vec4<f32>>(n | vec4<u32>(0x4B000000u)) - vec4<f32>(8388608.0);
}

// Q4_K's 6-bit (scale, min) of sub-block j (0..7) from its 12 scale bytes in words s0, s1, s2
// (get_scale_min_k4), as floats; branch-free since neighbouring invocations differ in j.
fn k4_scale_min(s0: u32, s1: u32, s2: u32, j: u32) -> vec2<f32> {
    let k = 8u * (j & 3u);
    let a = (s0 >> k) & 0xffu;
    let b = (s1 >> k) & 0xffu;
    let c = (s2 >> k) & 0xffu;
    let lo = vec2<u32>(a & 63u, b & 63u);
    let hi = vec2<u32>((c & 15u) | ((a >> 6u) << 4u), (c >> 4u) | ((b >> 6u) << 4u));
    let v = select(lo, hi, j >= 4u);
    return bitcast<vec2<f32>>(v | vec2<u32>(0x4B000000u)) - vec2<f32>(8388608.0);
}

// Q6_K: the four bytes (low nibble | two high bits from qh's bits 0-1 of each byte) minus 32, as
// floats, exactly and without int-to-float conversions.
fn q6_minus32(lo: u32, qh: u32) -> vec4<f32> {
    let v = lo | ((qh & 0x03030303u) << 4u);
    let b = (vec4<u32>(v) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(0xffu);
    return bitcast<vec4<f32>>(b | vec4<u32>(0x4B000000u)) - vec4<f32>(8388640.0);
}

// The four signed bytes of w as floats without int-to-float conversions (quarter rate on
// NVIDIA): flipping the sign bits gives b + 128 in 0..255; 2^23 + that as float bits, minus
// 2^23 + 128, is b exactly.
fn i8x4_to_f32(w: u32) -> vec4<f32> {
    let u = (vec4<u32>(w ^ 0x80808080u) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(0xffu);
    return bitcast<vec4<f32>>(u | vec4<u32>(0x4B000000u)) - vec4<f32>(8388736.0);
}

@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
#if QTYPE == iq4_xs
#if KV_SHUFFLE
#if SUBGROUPS
    kv_lane = kv_iq4nl4(vec4<u32>(ids.sg_lane & 15u)).x;
#else
    // (Never dispatched: the host asks for shuffles only where subgroups exist.)
    kv_lane = kv_iq4nl4(vec4<u32>(ids.lid & 15u)).x;
#endif
#else
    if ids.lid < 16u {
        kv_table[ids.lid] = kv_iq4nl4(vec4<u32>(ids.lid)).x;
    }
    workgroupBarrier();
#endif
#endif
#if MOE
    let row0 = ids.wid.x * {{NR}}u;
    let token = ids.wid.z;
#if SUM
    // Every pick of the token in this workgroup: pick_step finds each step's expert and column.
    let picks = P.n_used;
    sum_picks_at = P.ids_offset + token * P.n_used;
    let w_base = P.w_offset;
    let x_col0 = token * P.x_col_token;
    let y_base = P.y_offset + token * P.y_stride;
#else
    let picks = 1u;
    let slot = ids.wid.y;
#if ROUTE
#if SUBGROUPS
    let route_lane = ids.sg_lane;
    let route_here = ids.sg_id == 0u;
#else
    // (Never dispatched: the host routes in this kernel only where subgroups exist.)
    let route_lane = ids.lid;
    let route_here = ids.lid < {{RSG}}u;
#endif
    if route_here {
        // Pick `slot` of this token; workgroup (0, 0, token) also writes all its picks.
        let with_shared = P.route_shared != 0u;
        let logits = P.route_logits + token * P.route_stride;
        let args = RouteArgs(logits, P.route_experts, P.n_used - select(0u, 1u, with_shared), with_shared,
            P.route_experts, logits + P.route_experts, P.ids_offset + token * P.n_used,
            ids.wid.x == 0u && slot == 0u, slot);
        let picked = route_token(route_lane, args);
        if route_lane == 0u {
            moe_expert = picked;
        }
    }
#else
    if ids.lid == 0u {
        moe_expert = IDS[P.ids_offset + token * P.n_used + slot];
    }
#endif
    // Uniform across the workgroup, so the early exit keeps the reduction's barriers uniform.
    let expert = workgroupUniformLoad(&moe_expert);
    if expert < P.expert_first || expert >= P.expert_first + P.expert_count {
        return;
    }
    let w_base = P.w_offset + (expert - P.expert_first) * P.rows * P.row_bytes;
    let x_col0 = token * P.x_col_token + slot * P.x_col_slot;
    let y_base = P.y_offset + (token * P.n_used + slot) * P.y_stride;
#endif
#else
    let picks = 1u;
    // CG column groups: workgroup i computes its rows for columns (i % CG) · NC onwards; the CG
    // workgroups of one row group are neighbours, so their reads of the same weights meet in L2.
    let row_group = group_index(ids) / {{CG}}u;
#if EXTRA
    let extra_groups = (P.extra_rows + {{NR}}u - 1u) / {{NR}}u;
    let extra_wg = row_group < extra_groups;
    let row0 = select(row_group - extra_groups, 0u, extra_wg) * {{NR}}u;
#else
    let row0 = row_group * {{NR}}u;
#endif
    let w_base = P.w_offset;
    let x_col0 = (group_index(ids) % {{CG}}u) * {{NC}}u;
    let y_base = P.y_offset + x_col0 * P.y_stride;
#endif
#if EXTRA
    let extra_row0 = select(0u, row_group, extra_wg) * {{NR}}u;
    if select(row0 >= P.rows, extra_row0 >= P.extra_rows, extra_wg) {
        return;
    }
    // Where this workgroup's results go and where its rows end.
    let out_row0 = select(row0, P.rows + extra_row0, extra_wg);
    let row_end = select(P.rows, P.rows + P.extra_rows, extra_wg);
#else
    if row0 >= P.rows {
        return;
    }
    let out_row0 = row0;
    let row_end = P.rows;
#endif
    var acc: array<vec4<f32>, {{ACC4}}>;
    x_base = (P.x_offset + x_col0 * P.x_stride) / 4u;
    x_col = P.x_stride / 4u;
#if PRE == head_rms
    for (var i = ids.lid; i < {{NC}}u * {{HEADS}}u; i += {{WG}}u) {
        head_inv[i] = head_rms_inv(x_col0 + i / {{HEADS}}u, i % {{HEADS}}u);
    }
    workgroupBarrier();
#endif
    // Rows past the end compute a copy of the last row and are not stored: no per-row branch, so
    // the loads of all NR rows sit in one basic block and are issued back to back.
#for r in 0..NR
    let rb{{r}} = w_base + min(row0 + {{r}}u, P.rows - 1u) * P.row_bytes;
#endfor
    var generic = true;
#if EXTRA
    if extra_wg {
        generic = false;
        let k4 = P.k / 4u;
        for (var v = ids.lid; v < k4; v += {{WG}}u) {
            var xv: array<vec4<f32>, {{NC}}>;
#for c in 0..NC
            xv[{{c}}] = x_at({{c}}u, v);
#endfor
#for r in 0..NR
            {
                let wv = W2[P.extra_offset + min(extra_row0 + {{r}}u, P.extra_rows - 1u) * k4 + v];
#for c in 0..NC
                acc[({{r}}u * {{NC}}u + {{c}}u) / 4u][({{r}}u * {{NC}}u + {{c}}u) % 4u] += dot(wv, xv[{{c}}]);
#endfor
            }
#endfor
        }
    } else {
#endif
#if QTYPE == iq4_xs
    // Invocation p takes quant words 2p, 2p+1 of the row (block p / 16, words i, i+1 of its 32),
    // so a subgroup reads 256 contiguous quant bytes per load pair and each block header as a
    // broadcast, decoded once for both words. Word i belongs to sub-block i / 4: its low nibbles
    // are weights 4(i % 4)..+3 of that sub-block, its high nibbles the same 16 further on. Two
    // pairs per iteration, all loads first, keep more bytes in flight per invocation. IQ4_XS rows
    // (136-byte multiples) always start 4-aligned.
    generic = false;
    let np = P.k / 16u;
    let nv = np * picks;
#if KV_SHUFFLE
    // Every invocation runs the workgroup's iterations (the shuffles need the whole subgroup); steps
    // past the end re-read the last pair, weighted 0 below.
    for (var v0 = ids.lid; v0 - ids.lid < nv; v0 += {{UNROLL}}u * {{WG}}u) {
#else
    for (var v0 = ids.lid; v0 < nv; v0 += {{UNROLL}}u * {{WG}}u) {
#endif
#for u in 0..UNROLL
        // Past the end (second pair only): re-read the last pair, weighted 0 below.
        let s{{u}} = pick_step(min(v0 + {{u}}u * {{WG}}u, nv - 1u), np);
        let p{{u}} = s{{u}}.step;
        let blk{{u}} = s{{u}}.w_byte / 4u + 34u * (p{{u}} >> 4u);
        let i{{u}} = 2u * (p{{u}} & 15u);
#for r in 0..NR
        let h0_{{u}}_{{r}} = W[rb{{r}} / 4u + blk{{u}}];
        let h1_{{u}}_{{r}} = W[rb{{r}} / 4u + blk{{u}} + 1u];
        let qa_{{u}}_{{r}} = W[rb{{r}} / 4u + blk{{u}} + 2u + i{{u}}];
        let qb_{{u}}_{{r}} = W[rb{{r}} / 4u + blk{{u}} + 3u + i{{u}}];
#endfor
        set_sq_live(v0 + {{u}}u * {{WG}}u < nv);
        let xv{{u}} = s{{u}}.x_vec + 64u * (p{{u}} >> 4u) + 8u * (i{{u}} >> 2u) + (i{{u}} & 3u);
        var xl{{u}}: array<vec4<f32>, {{NC}}>;
        var xm{{u}}: array<vec4<f32>, {{NC}}>;
        var xh{{u}}: array<vec4<f32>, {{NC}}>;
        var xn{{u}}: array<vec4<f32>, {{NC}}>;
#for c in 0..NC
        xl{{u}}[{{c}}] = x_at({{c}}u, xv{{u}});
        xm{{u}}[{{c}}] = x_at({{c}}u, xv{{u}} + 1u);
        xh{{u}}[{{c}}] = x_at({{c}}u, xv{{u}} + 4u);
        xn{{u}}[{{c}}] = x_at({{c}}u, xv{{u}} + 5u);
#endfor
#endfor
#for u in 0..UNROLL
        {
            let ib = i{{u}} >> 2u;
            let live = select(0.0, s{{u}}.weight, v0 + {{u}}u * {{WG}}u < nv);
#for r in 0..NR
            {
                let h0 = h0_{{u}}_{{r}};
                let ls = ((h1_{{u}}_{{r}} >> (4u * ib)) & 15u) | (((h0 >> (16u + 2u * ib)) & 3u) << 4u);
                // ls - 32 without an int-to-float conversion (quarter rate on NVIDIA): 2^23 + ls
                // as float bits, minus 2^23 + 32, exact.
                let dl = live * unpack2x16float(h0).x * (bitcast<f32>(ls | 0x4B000000u) - 8388640.0);
                let wl = kv_word_lo(qa_{{u}}_{{r}});
                let wm = kv_word_lo(qb_{{u}}_{{r}});
                let wh = kv_word_hi(qa_{{u}}_{{r}});
                let wn = kv_word_hi(qb_{{u}}_{{r}});
#for c in 0..NC
                acc[({{r}}u * {{NC}}u + {{c}}u) / 4u][({{r}}u * {{NC}}u + {{c}}u) % 4u] += dl * (dot(wl, xl{{u}}[{{c}}]) + dot(wm, xm{{u}}[{{c}}]) + dot(wh, xh{{u}}[{{c}}]) + dot(wn, xn{{u}}[{{c}}]));
#endfor
            }
#endfor
        }
#endfor
    }
#endif
#if QTYPE == q4_k
    // As IQ4_XS: invocation p takes quant words 2p, 2p+1 of the row (block p / 16, words i, i+1
    // of its 32; chunk c = i / 8 of 64 weights: low nibbles are sub-block 2c, high nibbles 2c+1).
    // Σ (d·sc·q − dmin·m)·x = d·sc·Σ q·x − dmin·m·Σ x, so the nibbles are dotted unscaled and the
    // activation sums are shared by all rows. Q4_K rows (144-byte multiples) start 4-aligned.
    generic = false;
    let np = P.k / 16u;
    let nv = np * picks;
    for (var v0 = ids.lid; v0 < nv; v0 += {{UNROLL}}u * {{WG}}u) {
#for u in 0..UNROLL
        let s{{u}} = pick_step(min(v0 + {{u}}u * {{WG}}u, nv - 1u), np);
        let p{{u}} = s{{u}}.step;
        let blk{{u}} = s{{u}}.w_byte / 4u + 36u * (p{{u}} >> 4u);
        let i{{u}} = 2u * (p{{u}} & 15u);
#for r in 0..NR
        let h0_{{u}}_{{r}} = W[rb{{r}} / 4u + blk{{u}}];
        let s0_{{u}}_{{r}} = W[rb{{r}} / 4u + blk{{u}} + 1u];
        let s1_{{u}}_{{r}} = W[rb{{r}} / 4u + blk{{u}} + 2u];
        let s2_{{u}}_{{r}} = W[rb{{r}} / 4u + blk{{u}} + 3u];
        let qa_{{u}}_{{r}} = W[rb{{r}} / 4u + blk{{u}} + 4u + i{{u}}];
        let qb_{{u}}_{{r}} = W[rb{{r}} / 4u + blk{{u}} + 5u + i{{u}}];
#endfor
        set_sq_live(v0 + {{u}}u * {{WG}}u < nv);
        let xv{{u}} = s{{u}}.x_vec + 64u * (p{{u}} >> 4u) + 16u * (i{{u}} >> 3u) + (i{{u}} & 7u);
        var xl{{u}}: array<vec4<f32>, {{NC}}>;
        var xm{{u}}: array<vec4<f32>, {{NC}}>;
        var xh{{u}}: array<vec4<f32>, {{NC}}>;
        var xn{{u}}: array<vec4<f32>, {{NC}}>;
#for c in 0..NC
        xl{{u}}[{{c}}] = x_at({{c}}u, xv{{u}});
        xm{{u}}[{{c}}] = x_at({{c}}u, xv{{u}} + 1u);
        xh{{u}}[{{c}}] = x_at({{c}}u, xv{{u}} + 8u);
        xn{{u}}[{{c}}] = x_at({{c}}u, xv{{u}} + 9u);
#endfor
#endfor
#for u in 0..UNROLL
        {
            let j = 2u * (i{{u}} >> 3u); // 2c: the low-nibble sub-block
            let live = select(0.0, s{{u}}.weight, v0 + {{u}}u * {{WG}}u < nv);
            var sx_lo: array<f32, {{NC}}>;
            var sx_hi: array<f32, {{NC}}>;
#for c in 0..NC
            sx_lo[{{c}}] = dot(xl{{u}}[{{c}}] + xm{{u}}[{{c}}], vec4<f32>(1.0));
            sx_hi[{{c}}] = dot(xh{{u}}[{{c}}] + xn{{u}}[{{c}}], vec4<f32>(1.0));
#endfor
#for r in 0..NR
            {
                let dm = live * unpack2x16float(h0_{{u}}_{{r}});
                let sm_lo = k4_scale_min(s0_{{u}}_{{r}}, s1_{{u}}_{{r}}, s2_{{u}}_{{r}}, j);
                let sm_hi = k4_scale_min(s0_{{u}}_{{r}}, s1_{{u}}_{{r}}, s2_{{u}}_{{r}}, j + 1u);
                let qa = qa_{{u}}_{{r}};
                let qb = qb_{{u}}_{{r}};
                let nl = nib4_f32(qa);
                let nm = nib4_f32(qb);
                let nh = nib4_f32(qa >> 4u);
                let nn = nib4_f32(qb >> 4u);
#for c in 0..NC
                acc[({{r}}u * {{NC}}u + {{c}}u) / 4u][({{r}}u * {{NC}}u + {{c}}u) % 4u] += dm.x * (sm_lo.x * (dot(nl, xl{{u}}[{{c}}]) + dot(nm, xm{{u}}[{{c}}])) + sm_hi.x * (dot(nh, xh{{u}}[{{c}}]) + dot(nn, xn{{u}}[{{c}}]))) - dm.y * (sm_lo.y * sx_lo[{{c}}] + sm_hi.y * sx_hi[{{c}}]);
#endfor
            }
#endfor
        }
#endfor
    }
#endif
#if QTYPE == q6_k
    // Invocation p takes l = 4(p % 8)..+3 of half h = (p / 8) % 2 of block p / 16: one word of
    // ql at 64h + l, one at 64h + 32 + l and one of qh at 32h + l give 16 weights (128h + 32g + l
    // for g = 0..3) whose 6-bit values are assembled four bytes at a time; g's scale is
    // scales[8h + l/16 + 2g]. Blocks are 210 bytes, so words are funnel-read (w_u32_at).
    generic = false;
    let np = P.k / 16u;
    let nv = np * picks;
    for (var v0 = ids.lid; v0 < nv; v0 += {{UNROLL}}u * {{WG}}u) {
#for u in 0..UNROLL
        let s{{u}} = pick_step(min(v0 + {{u}}u * {{WG}}u, nv - 1u), np);
        let p{{u}} = s{{u}}.step;
        let h{{u}} = (p{{u}} >> 3u) & 1u;
        let l{{u}} = 4u * (p{{u}} & 7u);
#for r in 0..NR
        let blk_{{u}}_{{r}} = rb{{r}} + s{{u}}.w_byte + 210u * (p{{u}} >> 4u);
        let qa_{{u}}_{{r}} = w_u32_at(blk_{{u}}_{{r}} + 64u * h{{u}} + l{{u}});
        let qb_{{u}}_{{r}} = w_u32_at(blk_{{u}}_{{r}} + 64u * h{{u}} + 32u + l{{u}});
        let qh_{{u}}_{{r}} = w_u32_at(blk_{{u}}_{{r}} + 128u + 32u * h{{u}} + l{{u}});
        // Scale bytes s, s+2, s+4, s+6 with s = 192 + 8h + l/16: bytes 0 and 2 of the words
        // read at s and s+4.
        let sa_{{u}}_{{r}} = w_u32_at(blk_{{u}}_{{r}} + 192u + 8u * h{{u}} + (l{{u}} >> 4u));
        let sb_{{u}}_{{r}} = w_u32_at(blk_{{u}}_{{r}} + 196u + 8u * h{{u}} + (l{{u}} >> 4u));
        let d_{{u}}_{{r}} = w_f16_at(blk_{{u}}_{{r}} + 208u);
#endfor
        set_sq_live(v0 + {{u}}u * {{WG}}u < nv);
        let xv{{u}} = s{{u}}.x_vec + 64u * (p{{u}} >> 4u) + 32u * h{{u}} + (l{{u}} >> 2u);
        var x0{{u}}: array<vec4<f32>, {{NC}}>;
        var x1{{u}}: array<vec4<f32>, {{NC}}>;
        var x2{{u}}: array<vec4<f32>, {{NC}}>;
        var x3{{u}}: array<vec4<f32>, {{NC}}>;
#for c in 0..NC
        x0{{u}}[{{c}}] = x_at({{c}}u, xv{{u}});
        x1{{u}}[{{c}}] = x_at({{c}}u, xv{{u}} + 8u);
        x2{{u}}[{{c}}] = x_at({{c}}u, xv{{u}} + 16u);
        x3{{u}}[{{c}}] = x_at({{c}}u, xv{{u}} + 24u);
#endfor
#endfor
#for u in 0..UNROLL
        {
            let live = select(0.0, s{{u}}.weight, v0 + {{u}}u * {{WG}}u < nv);
#for r in 0..NR
            {
                let qa = qa_{{u}}_{{r}};
                let qb = qb_{{u}}_{{r}};
                let qh = qh_{{u}}_{{r}};
                let v0 = q6_minus32(qa & 0x0f0f0f0fu, qh);
                let v1 = q6_minus32(qb & 0x0f0f0f0fu, qh >> 2u);
                let v2 = q6_minus32((qa >> 4u) & 0x0f0f0f0fu, qh >> 4u);
                let v3 = q6_minus32((qb >> 4u) & 0x0f0f0f0fu, qh >> 6u);
                let sc = i8x4_to_f32((sa_{{u}}_{{r}} & 0x00ff00ffu) | ((sb_{{u}}_{{r}} & 0x00ff00ffu) << 8u));
                let d = live * d_{{u}}_{{r}};
#for c in 0..NC
                acc[({{r}}u * {{NC}}u + {{c}}u) / 4u][({{r}}u * {{NC}}u + {{c}}u) % 4u] += d * (sc.x * dot(v0, x0{{u}}[{{c}}]) + sc.z * dot(v1, x1{{u}}[{{c}}]) + sc.y * dot(v2, x2{{u}}[{{c}}]) + sc.w * dot(v3, x3{{u}}[{{c}}]));
#endfor
            }
#endfor
        }
#endfor
    }
#endif
#if QTYPE == q8_0
    // Invocation g takes weights 8g..8g+7 (block g / 4, quarter g % 4): neighbours read
    // neighbouring 8-byte runs. Blocks are 34 bytes, so the run starts 2- or 4-aligned: three
    // words cover it either way and are funnel-shifted without a branch. The block scale applies
    // once to the dot product. Two groups per iteration, loads first, as for IQ4_XS.
    generic = false;
    let ng = P.k / 8u;
    let nv = ng * picks;
    for (var v0 = ids.lid; v0 < nv; v0 += {{UNROLL}}u * {{WG}}u) {
#for u in 0..UNROLL
        let s{{u}} = pick_step(min(v0 + {{u}}u * {{WG}}u, nv - 1u), ng);
        let g{{u}} = s{{u}}.step;
        let blk{{u}} = s{{u}}.w_byte + 34u * (g{{u}} >> 2u);
#for r in 0..NR
        let db_{{u}}_{{r}} = rb{{r}} + blk{{u}};
        let qb_{{u}}_{{r}} = db_{{u}}_{{r}} + 2u + 8u * (g{{u}} & 3u);
        let dw_{{u}}_{{r}} = W[db_{{u}}_{{r}} >> 2u];
        let wa_{{u}}_{{r}} = W[qb_{{u}}_{{r}} >> 2u];
        let wb_{{u}}_{{r}} = W[(qb_{{u}}_{{r}} >> 2u) + 1u];
        let wc_{{u}}_{{r}} = W[(qb_{{u}}_{{r}} >> 2u) + 2u];
#endfor
        set_sq_live(v0 + {{u}}u * {{WG}}u < nv);
        var xa{{u}}: array<vec4<f32>, {{NC}}>;
        var xb{{u}}: array<vec4<f32>, {{NC}}>;
#for c in 0..NC
        xa{{u}}[{{c}}] = x_at({{c}}u, s{{u}}.x_vec + 2u * g{{u}});
        xb{{u}}[{{c}}] = x_at({{c}}u, s{{u}}.x_vec + 2u * g{{u}} + 1u);
#endfor
#endfor
#for u in 0..UNROLL
        {
            let live = select(0.0, s{{u}}.weight, v0 + {{u}}u * {{WG}}u < nv);
#for r in 0..NR
            {
                let sh = (qb_{{u}}_{{r}} & 3u) * 8u;
                let q0 = (wa_{{u}}_{{r}} >> sh) | ((wb_{{u}}_{{r}} << 1u) << (31u - sh));
                let q1 = (wb_{{u}}_{{r}} >> sh) | ((wc_{{u}}_{{r}} << 1u) << (31u - sh));
                let d = live * unpack2x16float(dw_{{u}}_{{r}} >> ((db_{{u}}_{{r}} & 2u) * 8u)).x;
                let w0 = i8x4_to_f32(q0);
                let w1 = i8x4_to_f32(q1);
#for c in 0..NC
                acc[({{r}}u * {{NC}}u + {{c}}u) / 4u][({{r}}u * {{NC}}u + {{c}}u) % 4u] += d * (dot(w0, xa{{u}}[{{c}}]) + dot(w1, xb{{u}}[{{c}}]));
#endfor
            }
#endfor
        }
#endfor
    }
#endif
#if EXTRA
    }
#endif
    if generic {
        let ng = P.k / 8u;
        for (var v = ids.lid; v < ng * picks; v += {{WG}}u) {
            let s = pick_step(v, ng);
            let g = s.step;
            // Unrolled (#for): constant indices keep xa, xb and acc in registers.
            var xa: array<vec4<f32>, {{NC}}>;
            var xb: array<vec4<f32>, {{NC}}>;
#for c in 0..NC
            xa[{{c}}] = s.weight * x_at({{c}}u, s.x_vec + 2u * g);
            xb[{{c}}] = s.weight * x_at({{c}}u, s.x_vec + 2u * g + 1u);
#endfor
#for r in 0..NR
            // The branch (not the clamp) measured faster for the heavier generic decoders (Q4_K).
            if row0 + {{r}}u < P.rows {
                let w = dq8_{{QTYPE}}(rb{{r}} + s.w_byte, g);
#for c in 0..NC
                acc[({{r}}u * {{NC}}u + {{c}}u) / 4u][({{r}}u * {{NC}}u + {{c}}u) % 4u] += dot(w.a, xa[{{c}}]) + dot(w.b, xb[{{c}}]);
#endfor
            }
#endfor
        }
    }
    // The workgroup's sums: every accumulator (and every PRE=rms sum of squares) reduced within
    // its subgroup first, then one exchange through workgroup memory, summed in subgroup order —
    // the bytes of one wg_sum4 per vec4, with one barrier instead of two per vec4 (16 vec4 at
    // 8 rows × 8 columns). Outputs are read back from workgroup memory by index, so `acc` is only
    // ever indexed by constants and stays in registers. Without subgroups, wg_sum4's tree gives
    // one part: the whole workgroup's.
#if SUBGROUPS
    let part = ids.sg_id;
    let writes = ids.sg_lane == 0u;
    let n_sg = ids.n_sg;
#else
    let part = 0u;
    let writes = ids.lid == 0u;
    let n_sg = 1u;
#endif
#for a in 0..ACC4
    let red{{a}} = part_sum4(acc[{{a}}], ids);
#endfor
#if PRE == rms
#for a in 0..NC4
    let red_sq{{a}} = part_sum4(sq_part[{{a}}], ids);
#endfor
#endif
    if writes {
        let at = part * RED_VEC4;
#for a in 0..ACC4
        red_scratch[at + {{a}}u] = red{{a}};
#endfor
#if PRE == rms
#for a in 0..NC4
        red_scratch[at + {{ACC4}}u + {{a}}u] = red_sq{{a}};
#endfor
#endif
    }
    workgroupBarrier();
#if XN_STORE
    {
        // The normalised columns for the kernels after this one, each workgroup its slice of K
        // (the same value whichever workgroup writes it: every one reduced the same sums).
        let groups = (P.rows + {{NR}}u - 1u) / {{NR}}u;
        let k4 = P.k / 4u;
        let chunk = (k4 + groups - 1u) / groups;
        let v0 = row_group * chunk;
#for c in 0..NC
        let scale{{c}} = column_scale({{c}}u, n_sg);
#endfor
        for (var v = v0 + ids.lid; v < min(v0 + chunk, k4); v += {{WG}}u) {
#for c in 0..NC
            XN[(x_col0 + {{c}}u) * k4 + v] = X[x_base + {{c}}u * x_col + v] * (NORM[v] * scale{{c}});
#endfor
        }
    }
#endif
    // NR·NC outputs may outnumber the invocations (8 rows × 8 columns with 32). Neighbouring
    // invocations take neighbouring rows of one column, so the stores (and the conv epilogue's
    // slot state, a slot's channels side by side) are contiguous rather than a column apart.
    for (var i = ids.lid; i < {{NR}}u * {{NC}}u; i += {{WG}}u) {
        let r = i % {{NR}}u;
        let c = i / {{NR}}u;
        let a = r * {{NC}}u + c;
        if out_row0 + r < row_end {
            let o = y_base + c * P.y_stride + out_row0 + r;
            let y = workgroup_sum(a / 4u, a % 4u, n_sg) * column_scale(c, n_sg);
            store_out(o, out_row0 + r, x_col0 + c, y);
        }
    }
}
