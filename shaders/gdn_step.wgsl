// One decode position of a gated DeltaNet layer for every row of a step, from the conv output to the
// gated output (docs/numerics.md "Gated DeltaNet"): the L2 norms of q and k, beta and the decay,
// the delta-rule update of the v-head's state S, its read-out, and the per-head gated RMSNorm
// (RMSNorm(o) · NORM · SiLU(z)) — the work of the recurrent kernel plus the gated norm, in one
// dispatch over all slots. Grid (v_heads, rows); row r is slot SLOTS[slots_offset + r], whose
// states start at float slot · state_stride. A workgroup owns one whole head (COLS value columns,
// LANES lanes per column, each lane every LANES-th key row in registers), so the norm over the
// head's outputs needs no second kernel.
//
// Layouts as shaders/deltanet.wgsl: S of v-head n is (n · dv + j) · dk + i (value-major); q, k, v
// of row r at qkv_offset + r · qkv_stride + {q,k,v}_offset; beta/alpha logits as DeltaParams; z of
// row r at z_offset + r · z_stride + n · dv + j; the output likewise at out_offset + r · out_stride.
#include "common.wgsl"
#include "common_reduce.wgsl"
#define WG 256
#define LANES 2

struct StepParams {
    rows: u32,
    k_heads: u32,
    v_heads: u32,
    dk: u32,
    dv: u32,
    // 0: k-head of v-head n is n / (v_heads / k_heads) (qwen3next); 1: n % k_heads (qwen35*).
    pairing: u32,
    qkv_offset: u32,
    qkv_stride: u32,
    q_offset: u32,
    k_offset: u32,
    v_offset: u32,
    ba_offset: u32,
    ba_stride: u32,
    // beta of v-head n at ba_offset + r · ba_stride + beta_offset + (n / ba_group) · ba_group_stride
    // + n % ba_group; alpha likewise at alpha_offset.
    ba_group: u32,
    ba_group_stride: u32,
    beta_offset: u32,
    alpha_offset: u32,
    z_offset: u32,
    z_stride: u32,
    out_offset: u32,
    out_stride: u32,
    state_stride: u32,
    slots_offset: u32,
    eps: f32,
    q_scale: f32,
    norm_eps: f32,
}

const COLS: u32 = {{WG}}u / {{LANES}}u;
const MAX_DK: u32 = 128u;
const ROWS_PER_LANE: u32 = MAX_DK / {{LANES}}u;

var<immediate> P: StepParams;
@group(0) @binding(0) var<storage, read> QKV: array<f32>;
@group(0) @binding(1) var<storage, read> BA: array<f32>;
@group(0) @binding(2) var<storage, read> SSM_A: array<f32>;
@group(0) @binding(3) var<storage, read> DT_BIAS: array<f32>;
@group(0) @binding(4) var<storage, read> Z: array<f32>;
@group(0) @binding(5) var<storage, read> NORM: array<f32>;
@group(0) @binding(6) var<storage, read> SLOTS: array<u32>;
@group(0) @binding(7) var<storage, read_write> STATE: array<f32>;
@group(0) @binding(8) var<storage, read_write> OUT: array<f32>;

var<workgroup> sh_q: array<f32, MAX_DK>;
var<workgroup> sh_k: array<f32, MAX_DK>;
var<workgroup> kv_parts: array<f32, {{WG}}>;
var<workgroup> o_parts: array<f32, {{WG}}>;

fn k_head_of(n: u32) -> u32 {
    if P.pairing == 0u {
        return n / (P.v_heads / P.k_heads);
    }
    return n % P.k_heads;
}

fn ba_at(r: u32, n: u32, which: u32) -> f32 {
    return BA[P.ba_offset + r * P.ba_stride + which + (n / P.ba_group) * P.ba_group_stride + n % P.ba_group];
}

@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
    let n = ids.wid.x;
    let r = ids.wid.y;
    let lid = ids.lid;
    let col = lid / {{LANES}}u;
    let lane = lid % {{LANES}}u;
    let j = col;
    let col_valid = j < P.dv;
    let dk = P.dk;
    let kh = k_head_of(n);
    let qkv = P.qkv_offset + r * P.qkv_stride;
    let st = SLOTS[P.slots_offset + r] * P.state_stride + n * P.dv * dk;

    for (var i = lid; i < dk; i += {{WG}}u) {
        sh_q[i] = QKV[qkv + P.q_offset + kh * dk + i];
        sh_k[i] = QKV[qkv + P.k_offset + kh * dk + i];
    }
    // The state loads do not depend on q and k: issue them before the barrier.
    var s: array<f32, ROWS_PER_LANE>;
    for (var t = 0u; t < ROWS_PER_LANE; t++) {
        let i = lane + t * {{LANES}}u;
        if col_valid && i < dk {
            s[t] = STATE[st + j * dk + i];
        }
    }
    workgroupBarrier();
    // Every invocation sums the squares itself, in the same order (no reduction barriers).
    var qq = 0.0;
    var kk = 0.0;
    for (var i = 0u; i < dk; i++) {
        qq += sh_q[i] * sh_q[i];
        kk += sh_k[i] * sh_k[i];
    }
    let inv_q = P.q_scale / max(sqrt(qq), P.eps);
    let inv_k = 1.0 / max(sqrt(kk), P.eps);
    let x = ba_at(r, n, P.alpha_offset) + DT_BIAS[n];
    // softplus with the usual linear tail above 20 (as deltanet.wgsl).
    let softplus = select(log(1.0 + exp(x)), x, x > 20.0);
    let decay = exp(SSM_A[n] * softplus);
    let beta = 1.0 / (1.0 + exp(-ba_at(r, n, P.beta_offset)));

    var kv = 0.0;
    for (var t = 0u; t < ROWS_PER_LANE; t++) {
        let i = lane + t * {{LANES}}u;
        if i < dk {
            s[t] *= decay;
            kv += s[t] * sh_k[i] * inv_k;
        }
    }
    kv_parts[lid] = kv;
    workgroupBarrier();
    var kv_total = 0.0;
    for (var ln = 0u; ln < {{LANES}}u; ln++) {
        kv_total += kv_parts[col * {{LANES}}u + ln];
    }
    var v = 0.0;
    if col_valid {
        v = QKV[qkv + P.v_offset + n * P.dv + j];
    }
    let delta = beta * (v - kv_total);
    var o = 0.0;
    for (var t = 0u; t < ROWS_PER_LANE; t++) {
        let i = lane + t * {{LANES}}u;
        if i < dk {
            s[t] += sh_k[i] * inv_k * delta;
            o += s[t] * sh_q[i] * inv_q;
        }
    }
    o_parts[lid] = o;
    for (var t = 0u; t < ROWS_PER_LANE; t++) {
        let i = lane + t * {{LANES}}u;
        if col_valid && i < dk {
            STATE[st + j * dk + i] = s[t];
        }
    }
    workgroupBarrier();
    var o_total = 0.0;
    for (var ln = 0u; ln < {{LANES}}u; ln++) {
        o_total += o_parts[col * {{LANES}}u + ln];
    }
    // Gated RMSNorm over the head's dv outputs (lane 0 of each valid column contributes).
    let contributes = col_valid && lane == 0u;
    let sq = wg_sum(select(0.0, o_total * o_total, contributes), ids);
    let inv = inverseSqrt(sq / f32(P.dv) + P.norm_eps);
    if contributes {
        let z = Z[P.z_offset + r * P.z_stride + n * P.dv + j];
        OUT[P.out_offset + r * P.out_stride + n * P.dv + j] = o_total * inv * NORM[j] * (z / (1.0 + exp(-z)));
    }
}
