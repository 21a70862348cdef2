// One decode position of a gated DeltaNet layer for every row of a step, from the conv output to the
// gated output before its norm (docs/numerics.md "Gated DeltaNet"): the L2 norms of q and k, beta
// and the decay, the delta-rule update of the v-head's state S, its read-out o, and the gate
// o · NORM · SiLU(z). Grid (v_heads · parts, rows): a workgroup owns COLS value columns of one head
// (part g of head n takes columns g · COLS ..), so a one-row step spreads over v_heads · dv / COLS
// workgroups instead of one per head; row r is slot SLOTS[slots_offset + r], whose states start at
// float slot · state_stride. Each invocation takes CPC columns (WG / LANES apart), all their S
// loads issued first (several columns per invocation keep more bytes in flight when many rows
// stream their states). The per-head RMS of o needs every column, so each workgroup writes its
// columns' sum of o² to SQ[sq_offset + r · sq_stride + n · parts + g] and the output projection
// (matvec.wgsl PRE=head_rms) finishes the norm. That sum adds the part's columns in column order,
// so it has the same bits for any WG and CPC with the same COLS (the host picks CPC by the rows of
// a step; a row's bytes must not depend on the batch).
//
// S is value-major ((n · dv + j) · dk + i: a value column's dk floats are contiguous), so LANES
// neighbouring invocations share a column, each holding every LANES-th key row: their loads of a
// column are one contiguous run, and the column's dot products are subgroup sums (LANES is the
// subgroup size; without subgroups LANES = 1 and an invocation holds a whole column). Every S load
// is issued first.
//
// Layouts as shaders/deltanet.wgsl: q, k, v of row r at qkv_offset + r · qkv_stride +
// {q,k,v}_offset; beta/alpha logits as DeltaParams; z of row r at z_offset + r · z_stride + n · dv
// + j; the output likewise at out_offset + r · out_stride.
#include "common.wgsl"
#define WG 128
#define LANES 1
// Key rows per invocation (MAX_DK / LANES); value columns per invocation (a workgroup's columns
// are WG / LANES · CPC).
#define ROWS 128
#define CPC 1
#variants LANES=32 ROWS=4 WG=256 SUBGROUPS=1
#variants LANES=8 ROWS=16 WG=256 SUBGROUPS=1
#variants LANES=32 ROWS=4 WG=128 CPC=2 SUBGROUPS=1

// The immediates, declared with their field docs in rust/ops/gdn_step.rs (GdnStepParams).
#params GdnStepParams

// Column groups of a workgroup (invocations per column: LANES), and its columns.
const GROUPS: u32 = {{WG}}u / {{LANES}}u;
const COLS: u32 = GROUPS * {{CPC}}u;
// Each column's o² (0 for a column past the head's), for the part's sum in column order.
var<workgroup> col_sq: array<f32, COLS>;

var<immediate> P: GdnStepParams;
@group(0) @binding(0) var<storage, read> QKV: array<f32>;
@group(0) @binding(1) var<storage, read> BA: array<f32>;
@group(0) @binding(2) var<storage, read> SSM_A: array<f32>;
@group(0) @binding(3) var<storage, read> DT_BIAS: array<f32>;
@group(0) @binding(4) var<storage, read> Z: array<f32>;
@group(0) @binding(5) var<storage, read> NORM: array<f32>;
@group(0) @binding(6) var<storage, read> SLOTS: array<u32>;
@group(0) @binding(7) var<storage, read_write> STATE: array<f32>;
@group(0) @binding(8) var<storage, read_write> OUT: array<f32>;
@group(0) @binding(9) var<storage, read_write> SQ: array<f32>;

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
    let n = ids.wid.x / P.parts;
    let part = ids.wid.x % P.parts;
    let r = ids.wid.y;
    let lane = ids.lid % {{LANES}}u;
    let dk = P.dk;
    let kh = k_head_of(n);
    let qkv = P.qkv_offset + r * P.qkv_stride;
    let st = SLOTS[P.slots_offset + r] * P.state_stride + n * P.dv * dk;
    // Column c of this invocation, and whether it is one of the head's.
    var j: array<u32, {{CPC}}>;
    var valid: array<bool, {{CPC}}>;
#for c in 0..CPC
    j[{{c}}] = part * COLS + {{c}}u * GROUPS + ids.lid / {{LANES}}u;
    valid[{{c}}] = j[{{c}}] < P.dv;
#endfor

    // Every S load first: column j, key rows lane + t · LANES.
    var s: array<array<f32, {{ROWS}}>, {{CPC}}>;
#for c in 0..CPC
#for t in 0..ROWS
    if valid[{{c}}] && lane + {{t}}u * {{LANES}}u < dk {
        s[{{c}}][{{t}}] = STATE[st + j[{{c}}] * dk + lane + {{t}}u * {{LANES}}u];
    }
#endfor
#endfor
    // The columns' v and z too, before any arithmetic waits on a load.
    var v: array<f32, {{CPC}}>;
    var z: array<f32, {{CPC}}>;
#for c in 0..CPC
    v[{{c}}] = 0.0;
    z[{{c}}] = 0.0;
    if valid[{{c}}] {
        v[{{c}}] = QKV[qkv + P.v_offset + n * P.dv + j[{{c}}]];
        z[{{c}}] = Z[P.z_offset + r * P.z_stride + n * P.dv + j[{{c}}]];
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

#for c in 0..CPC
    {
        var kv = 0.0;
#for t in 0..ROWS
        s[{{c}}][{{t}}] *= decay;
        kv += s[{{c}}][{{t}}] * k[{{t}}];
#endfor
        kv = column_sum(kv);
        let delta = beta * (v[{{c}}] - kv);
        var op = 0.0;
#for t in 0..ROWS
        s[{{c}}][{{t}}] += k[{{t}}] * delta;
        op += s[{{c}}][{{t}}] * q[{{t}}];
        if valid[{{c}}] && lane + {{t}}u * {{LANES}}u < dk {
            STATE[st + j[{{c}}] * dk + lane + {{t}}u * {{LANES}}u] = s[{{c}}][{{t}}];
        }
#endfor
        let o = column_sum(op);
        if lane == 0u {
            col_sq[{{c}}u * GROUPS + ids.lid / {{LANES}}u] = select(0.0, o * o, valid[{{c}}]);
            if valid[{{c}}] {
                let zc = z[{{c}}];
                OUT[P.out_offset + r * P.out_stride + n * P.dv + j[{{c}}]] = o * NORM[j[{{c}}]] * (zc / (1.0 + exp(-zc)));
            }
        }
    }
#endfor
    // The part's sum of o², for the norm downstream.
    workgroupBarrier();
    if ids.lid == 0u {
        var sq = 0.0;
        for (var i = 0u; i < COLS; i++) {
            sq += col_sq[i];
        }
        SQ[P.sq_offset + r * P.sq_stride + n * P.parts + part] = sq;
    }
}
