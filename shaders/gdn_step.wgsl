// One decode position of a gated DeltaNet layer for every row of a step, from the conv output to the
// gated output (docs/numerics.md "Gated DeltaNet"): the L2 norms of q and k, beta and the decay,
// the delta-rule update of the v-head's state S, its read-out, and the per-head gated RMSNorm
// (RMSNorm(o) · NORM · SiLU(z)) — the work of the recurrent kernel plus the gated norm, in one
// dispatch over all slots. Grid (v_heads, rows); row r is slot SLOTS[slots_offset + r], whose
// states start at float slot · state_stride. A workgroup owns one whole head, so the norm over the
// head's outputs needs no second kernel.
//
// S is value-major ((n · dv + j) · dk + i: a value column's dk floats are contiguous), so LANES
// neighbouring invocations share a column, each holding every LANES-th key row: their loads of a
// column are one contiguous run, and the column's dot products are subgroup sums (LANES is the
// subgroup size; without subgroups LANES = 1 and an invocation holds a whole column). The workgroup
// walks the head's columns in PASSES passes of WG / LANES columns; every S load is issued first.
//
// Layouts as shaders/deltanet.wgsl: q, k, v of row r at qkv_offset + r · qkv_stride +
// {q,k,v}_offset; beta/alpha logits as DeltaParams; z of row r at z_offset + r · z_stride + n · dv
// + j; the output likewise at out_offset + r · out_stride.
#include "common.wgsl"
#include "common_reduce.wgsl"
#define WG 256
#define LANES 1
// Key rows per invocation (MAX_DK / LANES) and column passes (MAX_DV · LANES / WG).
#define ROWS 128
#define PASSES 1
#variants LANES=32 ROWS=4 PASSES=4 WG=1024 SUBGROUPS=1
#variants LANES=8 ROWS=16 PASSES=1 WG=1024 SUBGROUPS=1

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

fn k_head_of(n: u32) -> u32 {
    if P.pairing == 0u {
        return n / (P.v_heads / P.k_heads);
    }
    return n % P.k_heads;
}

fn ba_at(r: u32, n: u32, which: u32) -> f32 {
    return BA[P.ba_offset + r * P.ba_stride + which + (n / P.ba_group) * P.ba_group_stride + n % P.ba_group];
}

// The sum of v over the LANES invocations that share a column.
fn column_sum(v: f32) -> f32 {
#if SUBGROUPS
    return subgroupAdd(v);
#else
    return v;
#endif
}

@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
    let n = ids.wid.x;
    let r = ids.wid.y;
    let lane = ids.lid % {{LANES}}u;
    let cg = ids.lid / {{LANES}}u;
    let dk = P.dk;
    let kh = k_head_of(n);
    let qkv = P.qkv_offset + r * P.qkv_stride;
    let st = SLOTS[P.slots_offset + r] * P.state_stride + n * P.dv * dk;

    // Every S load first: column j = pass · COLS + cg, key rows lane + t · LANES.
    var s: array<array<f32, {{ROWS}}>, {{PASSES}}>;
#for p in 0..PASSES
    {
        let j = {{p}}u * COLS + cg;
#for t in 0..ROWS
        if j < P.dv && lane + {{t}}u * {{LANES}}u < dk {
            s[{{p}}][{{t}}] = STATE[st + j * dk + lane + {{t}}u * {{LANES}}u];
        }
#endfor
    }
#endfor
    // The columns' v and z too: a load inside each pass would wait a memory round trip per pass.
    var vs: array<f32, {{PASSES}}>;
    var zs: array<f32, {{PASSES}}>;
#for p in 0..PASSES
    if {{p}}u * COLS + cg < P.dv {
        vs[{{p}}] = QKV[qkv + P.v_offset + n * P.dv + {{p}}u * COLS + cg];
        zs[{{p}}] = Z[P.z_offset + r * P.z_stride + n * P.dv + {{p}}u * COLS + cg];
    }
#endfor
    var q: array<f32, {{ROWS}}>;
    var k: array<f32, {{ROWS}}>;
    var qq = 0.0;
    var kk = 0.0;
#for t in 0..ROWS
    if lane + {{t}}u * {{LANES}}u < dk {
        q[{{t}}] = QKV[qkv + P.q_offset + kh * dk + lane + {{t}}u * {{LANES}}u];
        k[{{t}}] = QKV[qkv + P.k_offset + kh * dk + lane + {{t}}u * {{LANES}}u];
        qq += q[{{t}}] * q[{{t}}];
        kk += k[{{t}}] * k[{{t}}];
    }
#endfor
    qq = column_sum(qq);
    kk = column_sum(kk);
    let inv_q = P.q_scale / max(sqrt(qq), P.eps);
    let inv_k = 1.0 / max(sqrt(kk), P.eps);
#for t in 0..ROWS
    q[{{t}}] *= inv_q;
    k[{{t}}] *= inv_k;
#endfor
    let x = ba_at(r, n, P.alpha_offset) + DT_BIAS[n];
    // softplus with the usual linear tail above 20 (as deltanet.wgsl).
    let softplus = select(log(1.0 + exp(x)), x, x > 20.0);
    let decay = exp(SSM_A[n] * softplus);
    let beta = 1.0 / (1.0 + exp(-ba_at(r, n, P.beta_offset)));

    var o: array<f32, {{PASSES}}>;
    var sq = 0.0;
#for p in 0..PASSES
    {
        let j = {{p}}u * COLS + cg;
        let valid = j < P.dv;
        var kv = 0.0;
#for t in 0..ROWS
        s[{{p}}][{{t}}] *= decay;
        kv += s[{{p}}][{{t}}] * k[{{t}}];
#endfor
        kv = column_sum(kv);
        let delta = beta * (vs[{{p}}] - kv);
        var op = 0.0;
#for t in 0..ROWS
        s[{{p}}][{{t}}] += k[{{t}}] * delta;
        op += s[{{p}}][{{t}}] * q[{{t}}];
        if valid && lane + {{t}}u * {{LANES}}u < dk {
            STATE[st + j * dk + lane + {{t}}u * {{LANES}}u] = s[{{p}}][{{t}}];
        }
#endfor
        o[{{p}}] = column_sum(op);
        if valid && lane == 0u {
            sq += o[{{p}}] * o[{{p}}];
        }
    }
#endfor
    // Gated RMSNorm over the head's dv outputs (lane 0 of each valid column contributes).
    let inv = inverseSqrt(wg_sum(sq, ids) / f32(P.dv) + P.norm_eps);
    if lane == 0u {
#for p in 0..PASSES
        {
            let j = {{p}}u * COLS + cg;
            if j < P.dv {
                let z = zs[{{p}}];
                OUT[P.out_offset + r * P.out_stride + n * P.dv + j] = o[{{p}}] * inv * NORM[j] * (z / (1.0 + exp(-z)));
            }
        }
#endfor
    }
}
