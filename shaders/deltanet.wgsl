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
// * prep + state: the chunked WY/UT form for chunks of 64 tokens starting at token first_token of
//   the call, which the caller puts on an absolute multiple of 64.
//   prep (grid (chunks, v_heads), 256 invocations, every chunk at once) stages 16-wide slices of
//   q and k in workgroup memory and works as small mat-mats: K^ K^T and Q^ K^T (64 x 64, each
//   invocation a 4 x 4 block), then the triangular solve T = (I + A)^-1 (by 16 x 16 blocks). It
//   writes T, the masked decayed q.k matrix P, the cumulative log-decays, the inverse norms and
//   the row scales of W and U to scratch.
//   wu (grid (chunks, v_heads, column blocks of 64 over W then U), 256 invocations) computes
//   W = T diag(beta e^gamma) K^ and U = T diag(beta) V, a 64-column block per workgroup: apart
//   from the prep, so four workgroups share a chunk's products where one ran them after its solve
//   (the H200 held one prep workgroup per SM at a time).
//   state (grid (ceil(dv / 16), v_heads), 256 invocations) walks the chunks in order, carrying a
//   dk x 16 column block of S in workgroup memory: V' = U - W S, O = e^gamma Q S + P V',
//   S = e^gamma_C S + K^T diag(.) V'; an invocation owns one chunk row and 4 value columns.
//   A last partial chunk behaves like zero padding, and its outputs are the same numbers as the
//   same rows of a full chunk (sums only run over real rows, or add exact zeros).
//   Every sum has a fixed order, so a chunk gives the same bytes in whatever call it runs.

#include "common.wgsl"
#define WG 64
#define OP recurrent
// Steps per unrolled iteration of the chunked kernels' inner loops (their loads issued together).
#define UNROLL 8
// state: W, q and P rows and 4 key rows of k read as vec4 (a second, vec4 view of the same
// read-only buffers): a quarter of the loads; the same products summed in the same order, so the
// same bytes.
#define VEC4 0
#variants OP=prep
#variants OP=wu
#variants OP=state
#variants OP=state VEC4=1

// The immediates, declared with their field docs in rust/ops/deltanet.rs (DeltaParams).
#params DeltaParams

const CHUNK: u32 = 64u;
// Recurrent: columns per workgroup and lanes per column (COLS * LANES = WG).
const COLS: u32 = 16u;
const LANES: u32 = 4u;
const MAX_DK: u32 = 128u;
const MAX_ROWS_PER_LANE: u32 = 32u;
// Chunked form: invocations per workgroup, value columns per state workgroup, and the width and
// row pitch of the slices prep stages (the pitch keeps column reads off one bank).
const CHUNK_WG: u32 = 256u;
const STATE_COLS: u32 = 16u;
const SLICE: u32 = 16u;
const SLICE_PITCH: u32 = 17u;
// wu: columns per workgroup, and the row pitch of its operand tile.
const WU_COLS: u32 = 64u;
const WU_B_PITCH: u32 = 68u;

var<immediate> P: DeltaParams;
@group(0) @binding(0) var<storage, read> QKV: array<f32>;
#if OP != state
#if OP != wu
@group(0) @binding(1) var<storage, read> BA: array<f32>;
@group(0) @binding(2) var<storage, read> SSM_A: array<f32>;
@group(0) @binding(3) var<storage, read> DT_BIAS: array<f32>;
#endif
#endif
#if OP == recurrent
@group(0) @binding(4) var<storage, read_write> STATE: array<f32>;
@group(0) @binding(5) var<storage, read_write> OUT: array<f32>;
#endif
#if OP == prep
@group(0) @binding(4) var<storage, read_write> SCRATCH: array<f32>;
#endif
#if OP == wu
@group(0) @binding(1) var<storage, read_write> SCRATCH: array<f32>;
#endif
#if OP == state
@group(0) @binding(1) var<storage, read> SCRATCH: array<f32>;
@group(0) @binding(2) var<storage, read_write> STATE: array<f32>;
@group(0) @binding(3) var<storage, read_write> OUT: array<f32>;
#if VEC4
@group(0) @binding(4) var<storage, read> QKV4: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> SCRATCH4: array<vec4<f32>>;
#endif
#endif

#if OP == recurrent
var<workgroup> rec_q: array<f32, MAX_DK>;
var<workgroup> rec_k: array<f32, MAX_DK>;
var<workgroup> rec_kv_parts: array<f32, {{WG}}>;
var<workgroup> rec_o_parts: array<f32, {{WG}}>;
#endif

#if OP == prep
// A, then T in place: row-major 64 x 64, strictly lower (the unit diagonal is implicit).
var<workgroup> prep_t: array<f32, 4096>;
// Slices of 64 rows x SLICE columns (row pitch SLICE_PITCH): k (and the W / U operand), and q.
var<workgroup> prep_ka: array<f32, 1088>;
var<workgroup> prep_qa: array<f32, 1088>;
var<workgroup> prep_gamma: array<f32, CHUNK>;
var<workgroup> prep_beta: array<f32, CHUNK>;
var<workgroup> prep_inv_q: array<f32, CHUNK>;
var<workgroup> prep_inv_k: array<f32, CHUNK>;
// beta e^gamma / |k| per row: the scale of k^ in W.
var<workgroup> prep_wk: array<f32, CHUNK>;
#endif

#if OP == wu
// The operand rows (W's scaled k^ or U's scaled v), 64 x WU_B_PITCH. T is read from scratch
// through the cache: staged here as well it cost occupancy (H200: W and U of a 2048-row piece
// 619 µs staged, 340 read through the cache).
var<workgroup> wu_b: array<f32, 4352>;
#endif

#if OP == state
// S[i][j0 + 4 g .. + 4] at 4 i + g, for key rows i < dk.
var<workgroup> st_s: array<vec4<f32>, 512>;
// V' of the chunk: row s, columns j0 + 4 g .. + 4 at 4 s + g.
var<workgroup> st_vp: array<vec4<f32>, 256>;
// e^(gamma_C - gamma_s) / |k_s| per row (0 past the chunk's end).
var<workgroup> st_kf: array<f32, CHUNK>;
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
#if OP != wu
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

// Scratch of chunk c, v-head n: W (64 x dk), U (64 x dv), P (64 x 64), T (64 x 64), then 64 each
// of gamma, inv_q, inv_k, W's row scales (beta e^gamma / |k|) and U's (beta).
struct ChunkScratch {
    w: u32,
    u: u32,
    p: u32,
    t: u32,
    tail: u32,
}

fn chunk_scratch(c: u32, n: u32) -> ChunkScratch {
    let stride = CHUNK * (P.dk + P.dv + 2u * CHUNK + 5u);
    let w = (c * P.v_heads + n) * stride;
    let u = w + CHUNK * P.dk;
    let p = u + CHUNK * P.dv;
    let t = p + CHUNK * CHUNK;
    return ChunkScratch(w, u, p, t, t + CHUNK * CHUNK);
}

#if OP == prep
@compute @workgroup_size(256)
fn main(ids: ComputeIds) {
    let lid = ids.lid;
    let c = ids.wid.x;
    let n = ids.wid.y;
    let kh = k_head_of(n);
    let dk = P.dk;
    let dv = P.dv;
    let t0 = P.first_token + c * CHUNK;
    let len = min(CHUNK, P.tokens - c * CHUNK);
    let sc = chunk_scratch(c, n);
    let p_base = sc.p;
    let tail = sc.tail;

    // Squared norms of q and k: four invocations per row, each every fourth element, partial sums
    // through prep_t (free until A is written).
    {
        let row = lid / 4u;
        var qq = 0.0;
        var kk = 0.0;
        if row < len {
            for (var i = lid % 4u; i < dk; i += 4u) {
                let qv = q_at(t0 + row, kh, i);
                let kv = k_at(t0 + row, kh, i);
                qq += qv * qv;
                kk += kv * kv;
            }
        }
        prep_t[lid] = qq;
        prep_t[CHUNK_WG + lid] = kk;
    }
    workgroupBarrier();
    var g = 0.0;
    if lid < CHUNK {
        let row = lid;
        var beta = 0.0;
        var inv_q = 0.0;
        var inv_k = 0.0;
        if row < len {
            let qq = ((prep_t[4u * row] + prep_t[4u * row + 1u]) + prep_t[4u * row + 2u]) + prep_t[4u * row + 3u];
            let kr = CHUNK_WG + 4u * row;
            let kk = ((prep_t[kr] + prep_t[kr + 1u]) + prep_t[kr + 2u]) + prep_t[kr + 3u];
            g = log_decay_of(t0 + row, n);
            beta = beta_of(t0 + row, n);
            inv_q = P.q_scale / max(sqrt(qq), P.eps);
            inv_k = 1.0 / max(sqrt(kk), P.eps);
        }
        prep_gamma[row] = g;
        prep_beta[row] = beta;
        prep_inv_q[row] = inv_q;
        prep_inv_k[row] = inv_k;
    }
    workgroupBarrier();
    var gamma = 0.0;
    if lid < CHUNK {
        for (var s = 0u; s <= lid; s++) {
            gamma += prep_gamma[s];
        }
    }
    workgroupBarrier();
    if lid < CHUNK {
        prep_gamma[lid] = gamma;
        prep_wk[lid] = prep_beta[lid] * exp(gamma) * prep_inv_k[lid];
        SCRATCH[tail + lid] = gamma;
        SCRATCH[tail + CHUNK + lid] = prep_inv_q[lid];
        SCRATCH[tail + 2u * CHUNK + lid] = prep_inv_k[lid];
        SCRATCH[tail + 3u * CHUNK + lid] = prep_wk[lid];
        SCRATCH[tail + 4u * CHUNK + lid] = prep_beta[lid];
    }

    // K K^T and Q K^T of the raw rows over dk, a 16-wide slice at a time; invocation (tx, ty) owns
    // rows ty + 16 a and columns tx + 16 b (a, b < 4).
    let tx = lid % 16u;
    let ty = lid / 16u;
    var kkt: array<f32, 16>;
    var qkt: array<f32, 16>;
    for (var i0 = 0u; i0 < dk; i0 += SLICE) {
        workgroupBarrier();
        for (var e = lid; e < CHUNK * SLICE; e += CHUNK_WG) {
            let r = e / SLICE;
            let i = i0 + e % SLICE;
            var kv = 0.0;
            var qv = 0.0;
            if r < len && i < dk {
                kv = k_at(t0 + r, kh, i);
                qv = q_at(t0 + r, kh, i);
            }
            prep_ka[r * SLICE_PITCH + e % SLICE] = kv;
            prep_qa[r * SLICE_PITCH + e % SLICE] = qv;
        }
        workgroupBarrier();
        for (var ii = 0u; ii < SLICE; ii++) {
#for a in 0..4
            let ka{{a}} = prep_ka[(ty + 16u * {{a}}u) * SLICE_PITCH + ii];
            let qa{{a}} = prep_qa[(ty + 16u * {{a}}u) * SLICE_PITCH + ii];
#endfor
#for b in 0..4
            let kb{{b}} = prep_ka[(tx + 16u * {{b}}u) * SLICE_PITCH + ii];
#endfor
#for a in 0..4
#for b in 0..4
            kkt[{{a}}u * 4u + {{b}}u] += ka{{a}} * kb{{b}};
            qkt[{{a}}u * 4u + {{b}}u] += qa{{a}} * kb{{b}};
#endfor
#endfor
        }
    }
    // A[i][j] = beta_i (k^_i . k^_j) e^(gamma_i - gamma_j) for j < i; P[i][j] = (q^_i . k^_j)
    // e^(gamma_i - gamma_j) for j <= i. Both are 0 elsewhere (and on rows past the chunk's end).
#for a in 0..4
#for b in 0..4
    {
        let i = ty + 16u * {{a}}u;
        let j = tx + 16u * {{b}}u;
        var av = 0.0;
        var pv = 0.0;
        if j <= i && i < len {
            let decay = exp(prep_gamma[i] - prep_gamma[j]);
            pv = qkt[{{a}}u * 4u + {{b}}u] * prep_inv_q[i] * prep_inv_k[j] * decay;
            if j < i {
                av = prep_beta[i] * kkt[{{a}}u * 4u + {{b}}u] * prep_inv_k[i] * prep_inv_k[j] * decay;
            }
        }
        prep_t[i * CHUNK + j] = av;
        SCRATCH[p_base + i * CHUNK + j] = pv;
    }
#endfor
#endfor
    workgroupBarrier();

    // T = (I + A)^-1 in place (strictly lower; the unit diagonal implicit), by 16 x 16 blocks:
    // the four diagonal blocks row by row at once (T[i][j] = -(A[i][j] + sum_{j<m<i} A[i][m]
    // T[m][j]) within a block), then block row by block row X_IJ = sum_{J<=M<I} A_IM T_MJ and
    // T_IJ = -T_II X_IJ. A chain of 15 + 3 short steps instead of 63 rows (the H200 spent 54 µs
    // of a chunk's prep in the row-by-row solve). Rows past the chunk's end stay 0.
    {
        let b = lid / 16u;
        let jj = lid % 16u;
        let r0 = 16u * b;
        for (var i = 1u; i < 16u; i++) {
            let owns = lid < 64u && jj < i;
            var value = 0.0;
            if owns {
                let row = (r0 + i) * CHUNK + r0;
                value = prep_t[row + jj];
                for (var m = jj + 1u; m < i; m++) {
                    value += prep_t[row + m] * prep_t[(r0 + m) * CHUNK + r0 + jj];
                }
            }
            workgroupBarrier();
            if owns {
                prep_t[(r0 + i) * CHUNK + r0 + jj] = -value;
            }
            workgroupBarrier();
        }
    }
    {
        // Invocation (ri, cj) owns element (ri, cj) of each block of the block row; X goes to
        // prep_ka (free after the slices above), T_IJ over A_IJ once the row's X are all taken.
        let ri = lid / 16u;
        let cj = lid % 16u;
        for (var bi = 1u; bi < 4u; bi++) {
            let row = (16u * bi + ri) * CHUNK;
            for (var bj = 0u; bj < bi; bj++) {
                let c = 16u * bj + cj;
                var x = prep_t[row + c];
                for (var m = 16u * bj; m < 16u * bi; m++) {
                    x += prep_t[row + m] * prep_t[m * CHUNK + c];
                }
                prep_ka[bj * 256u + lid] = x;
            }
            workgroupBarrier();
            for (var bj = 0u; bj < bi; bj++) {
                var t = prep_ka[bj * 256u + lid];
                for (var m = 0u; m < ri; m++) {
                    t += prep_t[row + 16u * bi + m] * prep_ka[bj * 256u + m * 16u + cj];
                }
                prep_t[row + 16u * bj + cj] = -t;
            }
            workgroupBarrier();
        }
    }

    for (var e = lid; e < CHUNK * CHUNK; e += CHUNK_WG) {
        SCRATCH[sc.t + e] = prep_t[e];
    }
}
#endif

// W = T diag(beta e^gamma / |k|) K and U = T diag(beta) V for 64 columns (block wid.z of W's
// columns, then of U's); invocation (tx, ty) owns rows ty + 16 a and columns tx + 16 b.
// Row i's sum runs s = 0, 1, ... < len in order (T's zeros on and above the diagonal add exact
// zeros).
#if OP == wu
// The chunk and v-head of workgroup (c, n, ·).
struct Chunk {
    n: u32,
    kh: u32,
    t0: u32,
    len: u32,
    sc: ChunkScratch,
}

fn chunk_of(wid: vec3<u32>) -> Chunk {
    let c = wid.x;
    return Chunk(wid.y, k_head_of(wid.y), P.first_token + c * CHUNK, min(CHUNK, P.tokens - c * CHUNK),
        chunk_scratch(c, wid.y));
}

// Row r, column col of W's operand diag(beta e^gamma / |k|) K or U's diag(beta) V (0 outside).
fn wu_operand(ch: Chunk, is_w: bool, width: u32, r: u32, col: u32) -> f32 {
    var bv = 0.0;
    if r < ch.len && col < width {
        if is_w {
            bv = SCRATCH[ch.sc.tail + 3u * CHUNK + r] * k_at(ch.t0 + r, ch.kh, col);
        } else {
            bv = SCRATCH[ch.sc.tail + 4u * CHUNK + r] * v_at(ch.t0 + r, ch.n, col);
        }
    }
    return bv;
}

@compute @workgroup_size(256)
fn main(ids: ComputeIds) {
    let lid = ids.lid;
    let ch = chunk_of(ids.wid);
    let w_blocks = (P.dk + WU_COLS - 1u) / WU_COLS;
    let is_w = ids.wid.z < w_blocks;
    let c0 = select((ids.wid.z - w_blocks) * WU_COLS, ids.wid.z * WU_COLS, is_w);
    let width = select(P.dv, P.dk, is_w);
    for (var e = lid; e < CHUNK * WU_COLS; e += CHUNK_WG) {
        let r = e / WU_COLS;
        wu_b[r * WU_B_PITCH + e % WU_COLS] = wu_operand(ch, is_w, width, r, c0 + e % WU_COLS);
    }
    workgroupBarrier();
    let tx = lid % 16u;
    let ty = lid / 16u;
    var acc: array<f32, 16>;
#for a in 0..4
#for b in 0..4
    acc[{{a}}u * 4u + {{b}}u] = wu_b[(ty + 16u * {{a}}u) * WU_B_PITCH + tx + 16u * {{b}}u];
#endfor
#endfor
    for (var s = 0u; s < ch.len; s++) {
#for a in 0..4
        let ti{{a}} = SCRATCH[ch.sc.t + (ty + 16u * {{a}}u) * CHUNK + s];
#endfor
#for b in 0..4
        let b{{b}} = wu_b[s * WU_B_PITCH + tx + 16u * {{b}}u];
#endfor
#for a in 0..4
#for b in 0..4
        acc[{{a}}u * 4u + {{b}}u] += ti{{a}} * b{{b}};
#endfor
#endfor
    }
#for a in 0..4
#for b in 0..4
    {
        let i = ty + 16u * {{a}}u;
        let col = c0 + tx + 16u * {{b}}u;
        if i < ch.len && col < width {
            if is_w {
                SCRATCH[ch.sc.w + i * P.dk + col] = acc[{{a}}u * 4u + {{b}}u];
            } else {
                SCRATCH[ch.sc.u + i * P.dv + col] = acc[{{a}}u * 4u + {{b}}u];
            }
        }
    }
#endfor
#endfor
}
#endif

#if OP == state
@compute @workgroup_size(256)
fn main(ids: ComputeIds) {
    let lid = ids.lid;
    let n = ids.wid.y;
    let kh = k_head_of(n);
    let dk = P.dk;
    let dv = P.dv;
    let j0 = ids.wid.x * STATE_COLS;
    // Phases a-c: invocation = (chunk row r, column group g of 4 value columns).
    let r = lid / 4u;
    let grp = lid % 4u;
    let jg = j0 + 4u * grp;

    for (var idx = lid; idx < dk * 4u; idx += CHUNK_WG) {
        let i = idx / 4u;
        let j = j0 + 4u * (idx % 4u);
        var s = vec4<f32>(0.0);
        for (var q = 0u; q < 4u; q++) {
            if j + q < dv {
                s[q] = STATE[state_index(n, j + q, i)];
            }
        }
        st_s[idx] = s;
    }
    for (var c = 0u; c < P.chunks; c++) {
        let len = min(CHUNK, P.tokens - c * CHUNK);
        let t0 = P.first_token + c * CHUNK;
        let sc = chunk_scratch(c, n);
        let base = sc.w;
        let u_base = sc.u;
        let p_base = sc.p;
        let tail = sc.tail;
        let gamma_last = SCRATCH[tail + len - 1u];
        workgroupBarrier();
        if lid < CHUNK {
            var kf = 0.0;
            if lid < len {
                kf = SCRATCH[tail + 2u * CHUNK + lid] * exp(gamma_last - SCRATCH[tail + lid]);
            }
            st_kf[lid] = kf;
        }

        // Phase a: W S and q S over the key rows; V' = U - W S.
        var ws = vec4<f32>(0.0);
        var qs = vec4<f32>(0.0);
#if VEC4
        // Rows of dk / 4 vec4, 4 per iteration (the host asks dk % 16 == 0).
        if r < len {
            let w_row = (base + r * dk) / 4u;
            let q_row = ((t0 + r) * P.qkv_token_stride + P.q_offset + kh * dk) / 4u;
            for (var i4 = 0u; i4 < dk / 4u; i4 += 4u) {
#for u in 0..4
                let w{{u}} = SCRATCH4[w_row + i4 + {{u}}u];
                let q{{u}} = QKV4[q_row + i4 + {{u}}u];
#endfor
#for u in 0..4
#for e in 0..4
                {
                    let sv = st_s[4u * (4u * (i4 + {{u}}u) + {{e}}u) + grp];
                    ws += w{{u}}[{{e}}] * sv;
                    qs += q{{u}}[{{e}}] * sv;
                }
#endfor
#endfor
            }
        }
#else
        if r < len {
            // UNROLL steps' loads issued before their multiply-adds (same order of sums): the
            // chain over chunks waits on each step's latency, not on its arithmetic.
            var i = 0u;
            for (; i + {{UNROLL}}u <= dk; i += {{UNROLL}}u) {
#for u in 0..UNROLL
                let s{{u}} = st_s[4u * (i + {{u}}u) + grp];
                let w{{u}} = SCRATCH[base + r * dk + i + {{u}}u];
                let q{{u}} = q_at(t0 + r, kh, i + {{u}}u);
#endfor
#for u in 0..UNROLL
                ws += w{{u}} * s{{u}};
                qs += q{{u}} * s{{u}};
#endfor
            }
            for (; i < dk; i++) {
                let s = st_s[4u * i + grp];
                ws += SCRATCH[base + r * dk + i] * s;
                qs += q_at(t0 + r, kh, i) * s;
            }
        }
#endif
        var vp = vec4<f32>(0.0);
        if r < len {
            for (var q = 0u; q < 4u; q++) {
                if jg + q < dv {
                    vp[q] = SCRATCH[u_base + r * dv + jg + q] - ws[q];
                }
            }
        }
        st_vp[lid] = vp;
        workgroupBarrier();

        // Phase b: O = e^gamma q^ S + P V' (P is 0 above the diagonal).
        if r < len {
            var o = exp(SCRATCH[tail + r]) * SCRATCH[tail + CHUNK + r] * qs;
            var s = 0u;
#if VEC4
            // P's row as vec4, 8 per iteration (p_base and CHUNK are multiples of 4); the scalar
            // loops below take the rest.
            let p_row = (p_base + r * CHUNK) / 4u;
            for (; s + 8u <= r + 1u; s += 8u) {
                let pa = SCRATCH4[p_row + s / 4u];
                let pb = SCRATCH4[p_row + s / 4u + 1u];
#for e in 0..4
                o += pa[{{e}}] * st_vp[4u * (s + {{e}}u) + grp];
#endfor
#for e in 0..4
                o += pb[{{e}}] * st_vp[4u * (s + 4u + {{e}}u) + grp];
#endfor
            }
#endif
            for (; s + {{UNROLL}}u <= r + 1u; s += {{UNROLL}}u) {
#for u in 0..UNROLL
                let p{{u}} = SCRATCH[p_base + r * CHUNK + s + {{u}}u];
                let v{{u}} = st_vp[4u * (s + {{u}}u) + grp];
#endfor
#for u in 0..UNROLL
                o += p{{u}} * v{{u}};
#endfor
            }
            for (; s <= r; s++) {
                o += SCRATCH[p_base + r * CHUNK + s] * st_vp[4u * s + grp];
            }
            for (var q = 0u; q < 4u; q++) {
                if jg + q < dv {
                    OUT[out_index(t0 + r, n, jg + q)] = o[q];
                }
            }
        }

        // Phase c (invocation = key row, column group): S = e^gamma_C S + sum_s k_s kf_s V'_s.
        // Phase a's reads of st_s are behind the barrier above.
        let decay = exp(gamma_last);
#if VEC4
        // Invocation = 4 key rows (one vec4 of each token's k) and a column group.
        for (var item = lid; item < dk; item += CHUNK_WG) {
            let i4 = item / 4u;
            let g4 = item % 4u;
            let k_base = (t0 * P.qkv_token_stride + P.k_offset + kh * dk) / 4u + i4;
            let k_stride = P.qkv_token_stride / 4u;
#for e in 0..4
            var acc{{e}} = decay * st_s[4u * (4u * i4 + {{e}}u) + g4];
#endfor
            var s = 0u;
            for (; s + 4u <= len; s += 4u) {
#for u in 0..4
                let k{{u}} = QKV4[k_base + (s + {{u}}u) * k_stride];
                let f{{u}} = st_kf[s + {{u}}u];
                let v{{u}} = st_vp[4u * (s + {{u}}u) + g4];
#endfor
#for u in 0..4
#for e in 0..4
                acc{{e}} += (k{{u}}[{{e}}] * f{{u}}) * v{{u}};
#endfor
#endfor
            }
            for (; s < len; s++) {
                let kv = QKV4[k_base + s * k_stride];
#for e in 0..4
                acc{{e}} += (kv[{{e}}] * st_kf[s]) * st_vp[4u * s + g4];
#endfor
            }
#for e in 0..4
            st_s[4u * (4u * i4 + {{e}}u) + g4] = acc{{e}};
#endfor
        }
#else
        for (var idx = lid; idx < dk * 4u; idx += CHUNK_WG) {
            let i = idx / 4u;
            let g4 = idx % 4u;
            var acc = decay * st_s[idx];
            var s = 0u;
            for (; s + {{UNROLL}}u <= len; s += {{UNROLL}}u) {
#for u in 0..UNROLL
                let k{{u}} = k_at(t0 + s + {{u}}u, kh, i);
                let f{{u}} = st_kf[s + {{u}}u];
                let v{{u}} = st_vp[4u * (s + {{u}}u) + g4];
#endfor
#for u in 0..UNROLL
                acc += (k{{u}} * f{{u}}) * v{{u}};
#endfor
            }
            for (; s < len; s++) {
                acc += (k_at(t0 + s, kh, i) * st_kf[s]) * st_vp[4u * s + g4];
            }
            st_s[idx] = acc;
        }
#endif
    }
    workgroupBarrier();
    for (var idx = lid; idx < dk * 4u; idx += CHUNK_WG) {
        let i = idx / 4u;
        let j = j0 + 4u * (idx % 4u);
        let s = st_s[idx];
        for (var q = 0u; q < 4u; q++) {
            if j + q < dv {
                STATE[state_index(n, j + q, i)] = s[q];
            }
        }
    }
}
#endif
