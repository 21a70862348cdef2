// Gated DeltaNet (docs/numerics.md "Gated DeltaNet" and the two sections after it) on the conv output of a GDN layer.
// Each entry point computes from raw inputs: the L2 norms of q and k (x / max(|x|, eps), q times
// q_scale = 1/sqrt(dk)), beta = sigmoid(b) and g = ssm_a * softplus(alpha + dt_bias).
//
// State S of v-head n (dk x dv, f32): element (key index i, value index j) at
// state_offset + (n * dv + j) * dk + i (value-major, the layout llama.cpp uses), so one value
// column is contiguous and columns evolve independently.
//
// Variants (OP):
// * recurrent: token by token (decode, and the head of a prefill that starts mid-chunk).
//   Grid (ceil(dv / COLS), v_heads); invocation = (column, lane), a lane owns every LANES-th key row
//   of its column in registers.
// * prep + state: the chunked WY/UT form for chunks of 64 tokens
//   starting at token first_token of the call, which the caller puts on an absolute multiple of 64.
//   prep (grid (chunks, v_heads), invocation = chunk row) writes per chunk and head: W, U, the
//   masked decayed q.k matrix P, the cumulative log-decays and the inverse norms to scratch.
//   state (grid (ceil(dv / COLS), v_heads)) walks the chunks in order, carrying a column block of S
//   in workgroup memory: V' = U - W S, O = e^gamma Q S + P V', S = e^gamma_C S + K^T diag(.) V'.
//   A last partial chunk behaves like zero padding, and its outputs are the same numbers as the
//   same rows of a full chunk (sums only run over real rows).

#include "common.wgsl"
#define WG 64
#define OP recurrent
#variants OP=prep
#variants OP=state

struct DeltaParams {
    tokens: u32,
    k_heads: u32,
    v_heads: u32,
    dk: u32,
    dv: u32,
    // 0: k-head of v-head n is n / (v_heads / k_heads) (qwen3next); 1: n % k_heads (qwen35*).
    pairing: u32,
    first_token: u32,
    chunks: u32,
    qkv_token_stride: u32,
    q_offset: u32,
    k_offset: u32,
    v_offset: u32,
    // beta logit of v-head n at ba_token_stride*t + beta_offset + (n / ba_group)*ba_group_stride
    // + n % ba_group; alpha logits likewise at alpha_offset (qwen3next groups them per k-head).
    ba_token_stride: u32,
    ba_group: u32,
    ba_group_stride: u32,
    beta_offset: u32,
    alpha_offset: u32,
    out_offset: u32,
    out_token_stride: u32,
    state_offset: u32,
    eps: f32,
    q_scale: f32,
    _pad0: u32,
    _pad1: u32,
}

const CHUNK: u32 = 64u;
// Recurrent: columns per workgroup and lanes per column (COLS * LANES = WG).
const COLS: u32 = 16u;
const LANES: u32 = 4u;
const MAX_DK: u32 = 128u;
const MAX_ROWS_PER_LANE: u32 = 32u;
// Chunk state: value columns per workgroup.
const STATE_COLS: u32 = 16u;
// Packed strictly-lower 64x64 matrix: row i holds i entries starting at i*(i-1)/2.
const TRI_LEN: u32 = 2016u;

var<immediate> P: DeltaParams;
@group(0) @binding(0) var<storage, read> QKV: array<f32>;
#if OP != state
@group(0) @binding(1) var<storage, read> BA: array<f32>;
@group(0) @binding(2) var<storage, read> SSM_A: array<f32>;
@group(0) @binding(3) var<storage, read> DT_BIAS: array<f32>;
#endif
#if OP == recurrent
@group(0) @binding(4) var<storage, read_write> STATE: array<f32>;
@group(0) @binding(5) var<storage, read_write> OUT: array<f32>;
#endif
#if OP == prep
@group(0) @binding(4) var<storage, read_write> SCRATCH: array<f32>;
#endif
#if OP == state
@group(0) @binding(1) var<storage, read> SCRATCH: array<f32>;
@group(0) @binding(2) var<storage, read_write> STATE: array<f32>;
@group(0) @binding(3) var<storage, read_write> OUT: array<f32>;
#endif

#if OP == recurrent
var<workgroup> rec_q: array<f32, MAX_DK>;
var<workgroup> rec_k: array<f32, MAX_DK>;
var<workgroup> rec_kv_parts: array<f32, {{WG}}>;
var<workgroup> rec_o_parts: array<f32, {{WG}}>;
#endif

#if OP == prep
var<workgroup> prep_tri: array<f32, TRI_LEN>;
var<workgroup> prep_gamma: array<f32, CHUNK>;
var<workgroup> prep_beta: array<f32, CHUNK>;
var<workgroup> prep_inv_k: array<f32, CHUNK>;
#endif

#if OP == state
var<workgroup> st_s: array<f32, 2048>;
var<workgroup> st_vp: array<f32, 1024>;
var<workgroup> st_gamma: array<f32, CHUNK>;
var<workgroup> st_inv_k: array<f32, CHUNK>;
#endif

fn k_head_of(n: u32) -> u32 {
    if P.pairing == 0u {
        return n / (P.v_heads / P.k_heads);
    }
    return n % P.k_heads;
}

fn q_at(t: u32, kh: u32, i: u32) -> f32 {
    return QKV[t * P.qkv_token_stride + P.q_offset + kh * P.dk + i];
}

fn k_at(t: u32, kh: u32, i: u32) -> f32 {
    return QKV[t * P.qkv_token_stride + P.k_offset + kh * P.dk + i];
}

fn v_at(t: u32, n: u32, j: u32) -> f32 {
    return QKV[t * P.qkv_token_stride + P.v_offset + n * P.dv + j];
}

#if OP != state
fn ba_index(t: u32, n: u32, which_offset: u32) -> u32 {
    return t * P.ba_token_stride + which_offset + (n / P.ba_group) * P.ba_group_stride
        + n % P.ba_group;
}

fn beta_of(t: u32, n: u32) -> f32 {
    return 1.0 / (1.0 + exp(-BA[ba_index(t, n, P.beta_offset)]));
}

// g <= 0, the log-decay of one token.
fn log_decay_of(t: u32, n: u32) -> f32 {
    let x = BA[ba_index(t, n, P.alpha_offset)] + DT_BIAS[n];
    // softplus with the usual linear tail above 20 (FLA / torch threshold).
    let softplus = select(log(1.0 + exp(x)), x, x > 20.0);
    return SSM_A[n] * softplus;
}

#endif

fn state_index(n: u32, j: u32, i: u32) -> u32 {
    return P.state_offset + (n * P.dv + j) * P.dk + i;
}

fn out_index(t: u32, n: u32, j: u32) -> u32 {
    return P.out_offset + t * P.out_token_stride + n * P.dv + j;
}

#if OP == recurrent
@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
    let wid = ids.wid;
    let lid = ids.lid;
    let n = wid.y;
    let kh = k_head_of(n);
    let col = lid / LANES;
    let lane = lid % LANES;
    let j = wid.x * COLS + col;
    let col_valid = j < P.dv;
    let dk = P.dk;

    // Loops over s run a constant MAX_ROWS_PER_LANE times (rows past dk are skipped) so compilers
    // can unroll them and keep s in registers.
    var s: array<f32, MAX_ROWS_PER_LANE>;
    for (var r = 0u; r < MAX_ROWS_PER_LANE; r++) {
        let i = lane + r * LANES;
        s[r] = 0.0;
        if col_valid && i < dk {
            s[r] = STATE[state_index(n, j, i)];
        }
    }
    for (var step = 0u; step < P.tokens; step++) {
        let t = P.first_token + step;
        for (var i = lid; i < dk; i += {{WG}}u) {
            rec_q[i] = q_at(t, kh, i);
            rec_k[i] = k_at(t, kh, i);
        }
        workgroupBarrier();
        // Every invocation sums the squares itself, in the same order: no extra barriers.
        var qq = 0.0;
        var kk = 0.0;
        for (var i = 0u; i < dk; i++) {
            qq += rec_q[i] * rec_q[i];
            kk += rec_k[i] * rec_k[i];
        }
        let inv_q = P.q_scale / max(sqrt(qq), P.eps);
        let inv_k = 1.0 / max(sqrt(kk), P.eps);
        let decay = exp(log_decay_of(t, n));
        let beta = beta_of(t, n);

        var kv = 0.0;
        for (var r = 0u; r < MAX_ROWS_PER_LANE; r++) {
            let i = lane + r * LANES;
            if i < dk {
                s[r] *= decay;
                kv += s[r] * rec_k[i] * inv_k;
            }
        }
        rec_kv_parts[lid] = kv;
        workgroupBarrier();
        var kv_total = 0.0;
        for (var ln = 0u; ln < LANES; ln++) {
            kv_total += rec_kv_parts[col * LANES + ln];
        }
        var v = 0.0;
        if col_valid {
            v = v_at(t, n, j);
        }
        let delta = beta * (v - kv_total);
        var o = 0.0;
        for (var r = 0u; r < MAX_ROWS_PER_LANE; r++) {
            let i = lane + r * LANES;
            if i < dk {
                s[r] += rec_k[i] * inv_k * delta;
                o += s[r] * rec_q[i] * inv_q;
            }
        }
        rec_o_parts[lid] = o;
        workgroupBarrier();
        if col_valid && lane == 0u {
            var o_total = 0.0;
            for (var ln = 0u; ln < LANES; ln++) {
                o_total += rec_o_parts[col * LANES + ln];
            }
            OUT[out_index(t, n, j)] = o_total;
        }
        workgroupBarrier();
    }
    for (var r = 0u; r < MAX_ROWS_PER_LANE; r++) {
        let i = lane + r * LANES;
        if col_valid && i < dk {
            STATE[state_index(n, j, i)] = s[r];
        }
    }
}

#endif

// Scratch of chunk c, v-head n: W (64 x dk), U (64 x dv), P (64 x 64), gamma, inv_q, inv_k (64 each).
fn scratch_base(c: u32, n: u32) -> u32 {
    let stride = CHUNK * (P.dk + P.dv + CHUNK + 3u);
    return (c * P.v_heads + n) * stride;
}

#if OP == prep
fn tri_index(i: u32, j: u32) -> u32 {
    return i * (i - 1u) / 2u + j;
}

// T[row][s] for s <= row: the unit diagonal is implicit in the packed storage.
fn t_entry(row: u32, s: u32) -> f32 {
    if s == row {
        return 1.0;
    }
    return prep_tri[tri_index(row, s)];
}
#endif

#if OP == prep
@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
    let wid = ids.wid;
    let lid = ids.lid;
    let c = wid.x;
    let n = wid.y;
    let kh = k_head_of(n);
    let dk = P.dk;
    let dv = P.dv;
    let row = lid;
    let t = P.first_token + c * CHUNK + row;
    let valid = c * CHUNK + row < P.tokens;
    let base = scratch_base(c, n);
    let w_base = base;
    let u_base = base + CHUNK * dk;
    let p_base = u_base + CHUNK * dv;
    let tail = p_base + CHUNK * CHUNK;

    var g = 0.0;
    var beta = 0.0;
    var inv_q = 0.0;
    var inv_k = 0.0;
    if valid {
        g = log_decay_of(t, n);
        beta = beta_of(t, n);
        var qq = 0.0;
        var kk = 0.0;
        for (var i = 0u; i < dk; i++) {
            let qv = q_at(t, kh, i);
            let kv = k_at(t, kh, i);
            qq += qv * qv;
            kk += kv * kv;
        }
        inv_q = P.q_scale / max(sqrt(qq), P.eps);
        inv_k = 1.0 / max(sqrt(kk), P.eps);
    }
    prep_gamma[row] = g;
    prep_beta[row] = beta;
    prep_inv_k[row] = inv_k;
    workgroupBarrier();
    var gamma = 0.0;
    for (var s = 0u; s <= row; s++) {
        gamma += prep_gamma[s];
    }
    workgroupBarrier();
    prep_gamma[row] = gamma;
    workgroupBarrier();

    // A[row][j] = beta_row (k_row . k_j) e^(gamma_row - gamma_j), j < row.
    for (var j = 0u; j < row; j++) {
        var a = 0.0;
        if valid {
            var dot = 0.0;
            for (var i = 0u; i < dk; i++) {
                dot += k_at(t, kh, i) * k_at(t - row + j, kh, i);
            }
            a = beta * dot * inv_k * prep_inv_k[j] * exp(gamma - prep_gamma[j]);
        }
        prep_tri[tri_index(row, j)] = a;
    }
    workgroupBarrier();
    // T = (I + A)^-1 in place, row by row: T[i][j] = -(A[i][j] + sum_{j<m<i} A[i][m] T[m][j]).
    for (var i = 1u; i < CHUNK; i++) {
        var value = 0.0;
        let j = lid;
        if j < i {
            value = prep_tri[tri_index(i, j)];
            for (var m = j + 1u; m < i; m++) {
                value += prep_tri[tri_index(i, m)] * prep_tri[tri_index(m, j)];
            }
        }
        workgroupBarrier();
        if j < i {
            prep_tri[tri_index(i, j)] = -value;
        }
        workgroupBarrier();
    }

    if valid {
        // W = T diag(beta e^gamma) K^, U = T diag(beta) V, P[row][s] = (q^_row . k^_s) e^(gamma_row - gamma_s).
        for (var i = 0u; i < dk; i++) {
            var acc = 0.0;
            for (var s = 0u; s <= row; s++) {
                let tv = t_entry(row, s);
                acc += tv * prep_beta[s] * exp(prep_gamma[s]) * prep_inv_k[s] * k_at(t - row + s, kh, i);
            }
            SCRATCH[w_base + row * dk + i] = acc;
        }
        for (var jv = 0u; jv < dv; jv++) {
            var acc = 0.0;
            for (var s = 0u; s <= row; s++) {
                let tv = t_entry(row, s);
                acc += tv * prep_beta[s] * v_at(t - row + s, n, jv);
            }
            SCRATCH[u_base + row * dv + jv] = acc;
        }
        for (var s = 0u; s <= row; s++) {
            var dot = 0.0;
            for (var i = 0u; i < dk; i++) {
                dot += q_at(t, kh, i) * k_at(t - row + s, kh, i);
            }
            SCRATCH[p_base + row * CHUNK + s] = dot * inv_q * prep_inv_k[s] * exp(gamma - prep_gamma[s]);
        }
    }
    SCRATCH[tail + row] = gamma;
    SCRATCH[tail + CHUNK + row] = inv_q;
    SCRATCH[tail + 2u * CHUNK + row] = inv_k;
}

#endif

#if OP == state
@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
    let wid = ids.wid;
    let lid = ids.lid;
    let n = wid.y;
    let kh = k_head_of(n);
    let dk = P.dk;
    let dv = P.dv;
    let j0 = wid.x * STATE_COLS;

    for (var idx = lid; idx < dk * STATE_COLS; idx += {{WG}}u) {
        let j = j0 + idx % STATE_COLS;
        st_s[idx] = select(0.0, STATE[state_index(n, j, idx / STATE_COLS)], j < dv);
    }
    for (var c = 0u; c < P.chunks; c++) {
        let valid = min(CHUNK, P.tokens - c * CHUNK);
        let base = scratch_base(c, n);
        let u_base = base + CHUNK * dk;
        let p_base = u_base + CHUNK * dv;
        let tail = p_base + CHUNK * CHUNK;
        st_gamma[lid] = SCRATCH[tail + lid];
        st_inv_k[lid] = SCRATCH[tail + 2u * CHUNK + lid];
        workgroupBarrier();

        // Phase a (invocation = chunk row): V' = U - W S and the inter-chunk part e^gamma q^ S.
        let row = lid;
        let t = P.first_token + c * CHUNK + row;
        var ws: array<f32, STATE_COLS>;
        var qs: array<f32, STATE_COLS>;
        for (var jj = 0u; jj < STATE_COLS; jj++) {
            ws[jj] = 0.0;
            qs[jj] = 0.0;
        }
        if row < valid {
            for (var i = 0u; i < dk; i++) {
                let w = SCRATCH[base + row * dk + i];
                let qv = q_at(t, kh, i);
                for (var jj = 0u; jj < STATE_COLS; jj++) {
                    let s = st_s[i * STATE_COLS + jj];
                    ws[jj] += w * s;
                    qs[jj] += qv * s;
                }
            }
        }
        var o_part: array<f32, STATE_COLS>;
        let q_factor = exp(st_gamma[row]) * SCRATCH[tail + CHUNK + row];
        for (var jj = 0u; jj < STATE_COLS; jj++) {
            let j = j0 + jj;
            var vp = 0.0;
            if row < valid && j < dv {
                vp = SCRATCH[u_base + row * dv + j] - ws[jj];
            }
            st_vp[row * STATE_COLS + jj] = vp;
            o_part[jj] = q_factor * qs[jj];
        }
        workgroupBarrier();

        // Phase b: the intra-chunk part P V' completes the outputs.
        if row < valid {
            for (var jj = 0u; jj < STATE_COLS; jj++) {
                let j = j0 + jj;
                if j < dv {
                    var acc = o_part[jj];
                    for (var s = 0u; s <= row; s++) {
                        acc += SCRATCH[p_base + row * CHUNK + s] * st_vp[s * STATE_COLS + jj];
                    }
                    OUT[out_index(t, n, j)] = acc;
                }
            }
        }
        // Phase c (invocation = key rows): S = e^gamma_C S + sum_s k^_s e^(gamma_C - gamma_s) V'_s.
        // Phase b never reads st_s, so this needs no barrier before it.
        let gamma_last = st_gamma[valid - 1u];
        let decay = exp(gamma_last);
        for (var i = lid; i < dk; i += {{WG}}u) {
            var acc: array<f32, STATE_COLS>;
            for (var jj = 0u; jj < STATE_COLS; jj++) {
                acc[jj] = decay * st_s[i * STATE_COLS + jj];
            }
            for (var s = 0u; s < valid; s++) {
                let ts = P.first_token + c * CHUNK + s;
                let factor = k_at(ts, kh, i) * st_inv_k[s] * exp(gamma_last - st_gamma[s]);
                for (var jj = 0u; jj < STATE_COLS; jj++) {
                    acc[jj] += factor * st_vp[s * STATE_COLS + jj];
                }
            }
            for (var jj = 0u; jj < STATE_COLS; jj++) {
                st_s[i * STATE_COLS + jj] = acc[jj];
            }
        }
        workgroupBarrier();
    }
    for (var idx = lid; idx < dk * STATE_COLS; idx += {{WG}}u) {
        let j = j0 + idx % STATE_COLS;
        if j < dv {
            STATE[state_index(n, j, idx / STATE_COLS)] = st_s[idx];
        }
    }
}
#endif
