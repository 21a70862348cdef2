// Causal GQA attention over the KV cache with the Qwen3-Next sigmoid output gate (docs/numerics.md "Gated attention"),
// flash style: the keys of a row are cut into splits, each split keeps an online softmax (running
// max m, sum l, unnormalised output o) and writes it as a partial; OP=merge combines a row's
// partials, normalises and gates. OP=prepare fills the cache first. Layouts and the host side:
// rust/ops/attention.rs.
//
// OP=prepare (docs/numerics.md "Gated attention"): grid (heads + kv_heads, rows), one workgroup per head row: q
// heads get their RMSNorm and partial NeoX RoPE into Q_OUT, kv heads' K its RMSNorm and RoPE and,
// with V, a store into the row's cache cell in the cache type (f32, f16, or q8_0 for K: blocks of
// 32 with an f16 scale, as ggml's quantize_row_q8_0). RoPE rotates the pairs (i, i + n_rot/2) by
// pos * theta_i with theta_i from FREQS (computed on the host in f64: in f32 on the GPU, exp2 of an
// exponent up to ~23 loses ~1e-6 relative, ~0.3 rad at position 262144); the angle is rounded to
// f32 as llama.cpp does, only its reduction to [-pi, pi] is careful, because Vulkan bounds sin/cos
// error only inside that range.
// OP=decode: grid (splits, kv heads, rows); a row is (slot, position) from ROWS (or a prefill
// piece's run). COLS columns of LANES invocations walk the split's keys, a column UNROLL keys per
// iteration (their loads issued together); a lane owns UPL units of 8 dims of every head of the
// GQA group, so a key's K and V rows are read once, coalesced, for all its q heads (q itself sits
// in workgroup memory). Scores are summed across the lanes by
// subgroup shuffles; each column keeps its own softmax state, merged across columns at the end.
// OP=prefill: grid (splits, kv heads, query tiles); a tile is TT consecutive tokens × the group's
// G heads (PR rows), LANES invocations per row, K and V staged in workgroup memory BK keys at a
// time and shared by every row of the tile.
// Splits: a row (tile) of n keys has splits of the smallest length min_split·2^k with at most
// max_splits of them (`plan`); the grid is sized for the longest, later splits exit at once.
#include "common.wgsl"
#if OP == prepare
#include "common_reduce.wgsl"
#endif
#if OP == merge
#include "common_reduce.wgsl"
#endif
#if OP != prepare
#include "common_attention.wgsl"
#endif
#define OP decode
#define K_TYPE 1
#define V_TYPE 1
#define HEAD_DIM 64
#define GROUP 2
#define LANES 8
#define UPL 1
#define COLS 4
#define UNROLL 4
#define PR 64
#define BK 16
#define WG 32
#define MAX_SPLITS 64
#variants OP=prefill LANES=4 UPL=2 WG=256
#variants OP=merge WG=256
#variants K_TYPE=0 V_TYPE=0
#variants K_TYPE=2 V_TYPE=0 OP=prefill LANES=1 UPL=8 WG=64
#variants K_TYPE=2 GROUP=3 LANES=4 UPL=2 WG=16
#variants K_TYPE=0 LANES=1 UPL=8 WG=4
#variants OP=prepare
#variants OP=prepare K_TYPE=0 V_TYPE=0
#variants OP=prepare K_TYPE=2

// The immediates, declared with their field docs in rust/ops/attention.rs (PrepareParams).
#params PrepareParams

const D: u32 = {{HEAD_DIM}}u;
const G: u32 = {{GROUP}}u;
const LANES: u32 = {{LANES}}u;
// 8-dim units per head row, and per lane.
const UNITS: u32 = D / 8u;
const UPL: u32 = {{UPL}}u;
const NO_SLOT: u32 = 0xffffffffu;
// Cache words of one (position, kv head) row: f32, f16 pairs, or q8_0 (D int8 in D/4 words, then
// D/32 f16 scales, two per word).
#if K_TYPE == 0
const K_ROW: u32 = D;
#endif
#if K_TYPE == 1
const K_ROW: u32 = D / 2u;
#endif
#if K_TYPE == 2
const K_ROW: u32 = D / 4u + (D / 32u + 1u) / 2u;
#endif
#if V_TYPE == 0
const V_ROW: u32 = D;
#else
const V_ROW: u32 = D / 2u;
#endif

// 2*pi split into a short head (exactly 201/32, so k * HEAD is exact for k < 2^16) and the rest:
// the reduction stays accurate up to angles of ~4e5 rad (262144 positions * theta_0 = 1).
const TWO_PI: f32 = 6.283185307179586;
const TWO_PI_HEAD: f32 = 6.28125;
const TWO_PI_TAIL: f32 = 0.0019353071795864769;

#if OP == prepare
var<immediate> P: PrepareParams;
#else
var<immediate> P: CoreParams;
#endif
@group(0) @binding(0) var<storage, read> ROWS: array<u32>;
#if OP == prepare
@group(0) @binding(1) var<storage, read> PROJ: array<f32>;
@group(0) @binding(2) var<storage, read> Q_NORM: array<f32>;
@group(0) @binding(3) var<storage, read> K_NORM: array<f32>;
@group(0) @binding(4) var<storage, read> FREQS: array<f32>;
@group(0) @binding(5) var<storage, read_write> Q_OUT: array<f32>;
#if K_TYPE == 0
@group(0) @binding(6) var<storage, read_write> K_CACHE: array<f32>;
#else
@group(0) @binding(6) var<storage, read_write> K_CACHE: array<u32>;
#endif
#if V_TYPE == 0
@group(0) @binding(7) var<storage, read_write> V_CACHE: array<f32>;
#else
@group(0) @binding(7) var<storage, read_write> V_CACHE: array<u32>;
#endif
#endif
#if OP == merge
@group(0) @binding(1) var<storage, read> GATE: array<f32>;
@group(0) @binding(2) var<storage, read> PART_O: array<mat2x4<f32>>;
@group(0) @binding(3) var<storage, read> PART_ML: array<vec2<f32>>;
@group(0) @binding(4) var<storage, read_write> OUT: array<f32>;
#endif
#if OP != merge
#if OP != prepare
@group(0) @binding(1) var<storage, read> Q: array<vec4<f32>>;
#if K_TYPE == 0
@group(0) @binding(2) var<storage, read> K_CACHE: array<vec4<f32>>;
#endif
#if K_TYPE == 1
@group(0) @binding(2) var<storage, read> K_CACHE: array<vec4<u32>>;
#endif
#if K_TYPE == 2
@group(0) @binding(2) var<storage, read> K_CACHE: array<u32>;
#endif
#if V_TYPE == 0
@group(0) @binding(3) var<storage, read> V_CACHE: array<vec4<f32>>;
#else
@group(0) @binding(3) var<storage, read> V_CACHE: array<vec4<u32>>;
#endif
@group(0) @binding(4) var<storage, read_write> PART_O: array<mat2x4<f32>>;
@group(0) @binding(5) var<storage, read_write> PART_ML: array<vec2<f32>>;
#endif
#endif

// (slot, position) of row r.
fn row_at(r: u32) -> vec2<u32> {
    if P.rows_from_buffer != 0u {
        return vec2<u32>(ROWS[2u * r], ROWS[2u * r + 1u]);
    }
    return vec2<u32>(P.slot, P.pos + r);
}

// The slot's index in these cache buffers, or NO_SLOT: rows of slots outside them (another buffer
// group's, or padding) are another dispatch's.
fn local_slot(slot: u32) -> u32 {
    let local = slot - P.first_slot;
    return select(NO_SLOT, local, slot != NO_SLOT && local < P.slots);
}

#if OP != prepare
// Keys of the tile holding row r: through the tile's last row's own position.
fn tile_keys(r: u32) -> u32 {
    let last = min((r / P.tile_rows + 1u) * P.tile_rows, P.rows) - 1u;
    return row_at(last).y + 1u;
}
#endif

#if OP != merge
#if OP != prepare
fn unpack8(w: vec4<u32>) -> mat2x4<f32> {
    return mat2x4<f32>(
        vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y)),
        vec4<f32>(unpack2x16float(w.z), unpack2x16float(w.w)),
    );
}

// First word of the cache row (slot local, position p, kv head g).
fn k_row(local: u32, p: u32, g: u32) -> u32 {
    return ((local * P.ctx + p) * P.kv_heads + g) * K_ROW;
}

fn v_row(local: u32, p: u32, g: u32) -> u32 {
    return ((local * P.ctx + p) * P.kv_heads + g) * V_ROW;
}

// Dims 8u..8u+8 of the K row starting at word w.
fn load_k(w: u32, u: u32) -> mat2x4<f32> {
#if K_TYPE == 0
    let i = w / 4u + 2u * u;
    return mat2x4<f32>(K_CACHE[i], K_CACHE[i + 1u]);
#endif
#if K_TYPE == 1
    return unpack8(K_CACHE[w / 4u + u]);
#endif
#if K_TYPE == 2
    let b = u / 4u;
    let d = unpack2x16float(K_CACHE[w + D / 4u + b / 2u])[b % 2u];
    let q0 = vec4<f32>(unpack4xI8(K_CACHE[w + 2u * u]));
    let q1 = vec4<f32>(unpack4xI8(K_CACHE[w + 2u * u + 1u]));
    return mat2x4<f32>(q0 * d, q1 * d);
#endif
}

fn load_v(w: u32, u: u32) -> mat2x4<f32> {
#if V_TYPE == 0
    let i = w / 4u + 2u * u;
    return mat2x4<f32>(V_CACHE[i], V_CACHE[i + 1u]);
#else
    return unpack8(V_CACHE[w / 4u + u]);
#endif
}

// Dims 8u..8u+8 of prepared q for row r, head h, times the attention scale.
fn load_q(r: u32, h: u32, u: u32) -> mat2x4<f32> {
    let i = (P.q_offset + r * P.q_row_stride + h * D) / 4u + 2u * u;
    return mat2x4<f32>(Q[i], Q[i + 1u]) * P.scale;
}

fn dot8(a: mat2x4<f32>, b: mat2x4<f32>) -> f32 {
    return dot(a[0], b[0]) + dot(a[1], b[1]);
}

// Sum over the LANES invocations sharing a key (decode) or a query row (prefill). A butterfly:
// every lane adds the same two values at each step, so all lanes end with identical bits.
fn lanes_sum(v: f32) -> f32 {
#if SUBGROUPS
    var s = v;
    for (var off = LANES / 2u; off > 0u; off >>= 1u) {
        s += subgroupShuffleXor(s, off);
    }
    return s;
#else
    return v;
#endif
}

// The lane within its LANES group and the group's index. Groups are aligned within subgroups
// (the host keeps LANES a divisor of the subgroup size), so shuffles never leave a group.
fn lane_group(ids: ComputeIds) -> vec2<u32> {
#if SUBGROUPS
    let lin = ids.sg_id * ids.sg_size + ids.sg_lane;
#else
    let lin = ids.lid;
#endif
    return vec2<u32>(lin % LANES, lin / LANES);
}
#endif
#endif

#if OP == decode
const COLS: u32 = {{COLS}}u;
const U: u32 = {{UNROLL}}u;
// The group's q heads (scaled), read by every column; the column merge's scratch.
var<workgroup> qs: array<mat2x4<f32>, G * UNITS>;
var<workgroup> comb_ml: array<vec2<f32>, COLS>;
var<workgroup> comb_o: array<mat2x4<f32>, COLS * UNITS>;

@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
    let split = ids.wid.x;
    let g = ids.wid.y;
    let r = ids.wid.z;
    let row = row_at(r);
    let local = local_slot(row.x);
    if local == NO_SLOT {
        return;
    }
    let n = row.y + 1u;
    let pl = plan(n);
    if split >= pl.y {
        return;
    }
    let start = split * pl.x;
    let end = min(start + pl.x, n);
    let lg = lane_group(ids);
    let lane = lg.x;
    let col = lg.y;
    for (var i = ids.lid; i < G * UNITS; i += {{WG}}u) {
        qs[i] = load_q(r, g * G + i / UNITS, i % UNITS);
    }
    workgroupBarrier();
    // Unrolled (#for) so these arrays keep constant indices and stay in registers.
    var o: array<mat2x4<f32>, G * UPL>;
    var m: array<f32, G>;
    var l: array<f32, G>;
#for h in 0..GROUP
    m[{{h}}] = MASKED;
    l[{{h}}] = 0.0;
#for j in 0..UPL
    o[{{h}} * UPL + {{j}}] = mat2x4<f32>();
#endfor
#endfor
    // U keys per column per iteration, their K and V loads issued together; the trip count is
    // uniform, keys past the end are masked (and read the last key again).
    let iters = (end - start + U * COLS - 1u) / (U * COLS);
    for (var it = 0u; it < iters; it++) {
        var kv: array<mat2x4<f32>, 2 * U * UPL>;
        var ok: array<bool, U>;
#for u in 0..UNROLL
        let key{{u}} = start + (it * U + {{u}}u) * COLS + col;
        ok[{{u}}] = key{{u}} < end;
        let kw{{u}} = k_row(local, min(key{{u}}, end - 1u), g);
        let vw{{u}} = v_row(local, min(key{{u}}, end - 1u), g);
#for j in 0..UPL
        kv[2u * ({{u}} * UPL + {{j}})] = load_k(kw{{u}}, {{j}}u * LANES + lane);
        kv[2u * ({{u}} * UPL + {{j}}) + 1u] = load_v(vw{{u}}, {{j}}u * LANES + lane);
#endfor
#endfor
#for h in 0..GROUP
        {
            var s: array<f32, U>;
#for u in 0..UNROLL
            s[{{u}}] = 0.0;
#endfor
#for j in 0..UPL
            let qv{{j}} = qs[{{h}}u * UNITS + {{j}}u * LANES + lane];
#for u in 0..UNROLL
            s[{{u}}] += dot8(qv{{j}}, kv[2u * ({{u}} * UPL + {{j}})]);
#endfor
#endfor
            var mn = m[{{h}}];
#for u in 0..UNROLL
            s[{{u}}] = select(MASKED, lanes_sum(s[{{u}}]), ok[{{u}}]);
            mn = max(mn, s[{{u}}]);
#endfor
            let c = exp(m[{{h}}] - mn);
            var sum = 0.0;
#for u in 0..UNROLL
            // Masked keys give exactly 0 even while mn is still MASKED.
            s[{{u}}] = select(0.0, exp(s[{{u}}] - mn), ok[{{u}}]);
            sum += s[{{u}}];
#endfor
            l[{{h}}] = l[{{h}}] * c + sum;
            m[{{h}}] = mn;
#for j in 0..UPL
            var acc{{j}} = o[{{h}} * UPL + {{j}}] * c;
#for u in 0..UNROLL
            acc{{j}} += kv[2u * ({{u}} * UPL + {{j}}) + 1u] * s[{{u}}];
#endfor
            o[{{h}} * UPL + {{j}}] = acc{{j}};
#endfor
        }
#endfor
    }
    // Merge the columns: per head, rescale each column's output to the common max and sum.
#for h in 0..GROUP
    {
        if lane == 0u {
            comb_ml[col] = vec2<f32>(m[{{h}}], l[{{h}}]);
        }
        workgroupBarrier();
        var mx = MASKED;
        for (var c = 0u; c < COLS; c++) {
            mx = max(mx, comb_ml[c].x);
        }
        let f = exp(m[{{h}}] - mx);
#for j in 0..UPL
        comb_o[col * UNITS + {{j}}u * LANES + lane] = o[{{h}} * UPL + {{j}}] * f;
#endfor
        workgroupBarrier();
        let e = part_index(r, g * G + {{h}}u, split);
        for (var u = ids.lid; u < UNITS; u += {{WG}}u) {
            var acc = mat2x4<f32>();
            for (var c = 0u; c < COLS; c++) {
                acc += comb_o[c * UNITS + u];
            }
            PART_O[e * UNITS + u] = acc;
        }
        if ids.lid == 0u {
            var total = 0.0;
            for (var c = 0u; c < COLS; c++) {
                total += comb_ml[c].y * exp(comb_ml[c].x - mx);
            }
            PART_ML[e] = vec2<f32>(mx, total);
        }
        workgroupBarrier();
    }
#endfor
}
#endif

#if OP == prefill
// Tokens per tile and keys per staged K/V block.
const TT: u32 = {{PR}}u / G;
const BK: u32 = {{BK}}u;
var<workgroup> tile: array<mat2x4<f32>, BK * UNITS>;

@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
    let split = ids.wid.x;
    let g = ids.wid.y;
    let t_first = ids.wid.z * TT;
    if t_first >= P.rows {
        return;
    }
    let n = tile_keys(t_first);
    let pl = plan(n);
    if split >= pl.y {
        return;
    }
    let start = split * pl.x;
    let end = min(start + pl.x, n);
    let local = P.slot - P.first_slot;
    let lg = lane_group(ids);
    let lane = lg.x;
    let qrow = lg.y;
    let t = t_first + qrow / G;
    let h = g * G + qrow % G;
    let live = qrow < TT * G && t < P.rows;
    // Keys up to the row's own position are visible.
    let own = row_at(min(t, P.rows - 1u)).y;

    // Unrolled (#for) so these arrays keep constant indices and stay in registers.
    var q: array<mat2x4<f32>, UPL>;
    var o: array<mat2x4<f32>, UPL>;
#for j in 0..UPL
    q[{{j}}] = mat2x4<f32>();
    if live {
        q[{{j}}] = load_q(t, h, {{j}}u * LANES + lane);
    }
    o[{{j}}] = mat2x4<f32>();
#endfor
    var m = MASKED;
    var l = 0.0;
    for (var k0 = start; k0 < end; k0 += BK) {
        workgroupBarrier();
        for (var i = ids.lid; i < BK * UNITS; i += {{WG}}u) {
            tile[i] = load_k(k_row(local, min(k0 + i / UNITS, end - 1u), g), i % UNITS);
        }
        workgroupBarrier();
        var p: array<f32, BK>;
        var mx = MASKED;
#for kk in 0..BK
        {
            var acc = 0.0;
#for j in 0..UPL
            acc += dot8(q[{{j}}], tile[{{kk}}u * UNITS + {{j}}u * LANES + lane]);
#endfor
            let key = k0 + {{kk}}u;
            p[{{kk}}] = select(MASKED, lanes_sum(acc), key < end && key <= own);
            mx = max(mx, p[{{kk}}]);
        }
#endfor
        let mn = max(m, mx);
        let c = exp(m - mn);
        var sum = 0.0;
#for kk in 0..BK
        p[{{kk}}] = select(exp(p[{{kk}}] - mn), 0.0, p[{{kk}}] == MASKED);
        sum += p[{{kk}}];
#endfor
        l = l * c + sum;
        m = mn;
        workgroupBarrier();
        for (var i = ids.lid; i < BK * UNITS; i += {{WG}}u) {
            tile[i] = load_v(v_row(local, min(k0 + i / UNITS, end - 1u), g), i % UNITS);
        }
        workgroupBarrier();
#for j in 0..UPL
        {
            var acc = o[{{j}}] * c;
#for kk in 0..BK
            acc += tile[{{kk}}u * UNITS + {{j}}u * LANES + lane] * p[{{kk}}];
#endfor
            o[{{j}}] = acc;
        }
#endfor
    }
    if live {
        let e = part_index(t, h, split);
#for j in 0..UPL
        PART_O[e * UNITS + {{j}}u * LANES + lane] = o[{{j}}];
#endfor
        if lane == 0u {
            PART_ML[e] = vec2<f32>(m, l);
        }
    }
}
#endif

#if OP == merge
// Each split's weight exp(m_s - max); the output sums of the split groups, one per invocation.
var<workgroup> split_scale: array<f32, {{MAX_SPLITS}}>;
var<workgroup> unit_acc: array<mat2x4<f32>, {{WG}}>;

// Grid (heads, rows): the invocations share a row head's splits for the max and the sum, then
// invocation i adds unit i % UNITS of every (WG / UNITS)-th split from split i / UNITS on (a row
// with 256 splits is not 256 dependent loads per invocation), and the groups' sums are added.
@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
    let h = ids.wid.x;
    let r = ids.wid.y;
    if row_at(r).x == NO_SLOT {
        return;
    }
    let splits = plan(tile_keys(r)).y;
    let first = part_index(r, h, 0u);
    var mx = MASKED;
    for (var s = ids.lid; s < splits; s += {{WG}}u) {
        mx = max(mx, PART_ML[first + s].x);
    }
    mx = wg_max(mx, ids);
    var total = 0.0;
    for (var s = ids.lid; s < splits; s += {{WG}}u) {
        let e = exp(PART_ML[first + s].x - mx);
        split_scale[s] = e;
        total += PART_ML[first + s].y * e;
    }
    total = wg_sum(total, ids);
    workgroupBarrier();
    let groups = {{WG}}u / UNITS;
    let u = ids.lid % UNITS;
    let group = ids.lid / UNITS;
    var acc = mat2x4<f32>();
    if group < groups {
        for (var s = group; s < splits; s += groups) {
            acc += PART_O[(first + s) * UNITS + u] * split_scale[s];
        }
    }
    unit_acc[ids.lid] = acc;
    workgroupBarrier();
    if group != 0u {
        return;
    }
    var sum = unit_acc[u];
    for (var g = 1u; g < groups; g++) {
        sum += unit_acc[g * UNITS + u];
    }
    let out = P.out_offset + r * P.out_row_stride + h * D;
    let gate = P.gate_offset + r * P.gate_row_stride + h * P.gate_head_stride;
    for (var i = 0u; i < 8u; i++) {
        var y = sum[i / 4u][i % 4u] / total;
        if P.gated != 0u {
            y /= 1.0 + exp(-GATE[gate + 8u * u + i]);
        }
        OUT[out + 8u * u + i] = y;
    }
}
#endif

#if OP == prepare
// Elements of a head per invocation, and pairs of its V row.
const PER_LANE_D: u32 = (D + {{WG}}u - 1u) / {{WG}}u;
const PER_LANE_V: u32 = (D / 2u + {{WG}}u - 1u) / {{WG}}u;
var<workgroup> vals: array<f32, D>;
var<workgroup> block_scale: array<f32, D / 32u + 1u>;

@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
    let item = ids.wid.x;
    let r = ids.wid.y;
    let row = row_at(r);
    let local = local_slot(row.x);
    if local == NO_SLOT {
        return;
    }
    let pos = row.y;
    let is_q = item < P.heads;
    let g = item - P.heads;
    let base = r * P.proj_row_stride;
    var src = base + P.k_offset + g * D;
    if is_q {
        src = base + P.q_offset + item * P.q_head_stride;
    }
    let half = P.n_rot / 2u;
    // Every load of this workgroup is issued before its first barrier: its elements of the head,
    // their norm weights and rotation frequencies, and (a kv head) the V row it stores; each was a
    // further round trip after a barrier. The same operations in the same order as one after the
    // other, so the same bytes.
    var xs: array<f32, PER_LANE_D>;
    var ws: array<f32, PER_LANE_D>;
    var freqs: array<f32, PER_LANE_D>;
    var vs: array<vec2<f32>, PER_LANE_V>;
    for (var j = 0u; j < PER_LANE_D; j++) {
        let d = ids.lid + j * {{WG}}u;
        if d < D {
            xs[j] = PROJ[src + d];
            var w = K_NORM[d];
            if is_q {
                w = Q_NORM[d];
            }
            ws[j] = w;
            if d < P.n_rot {
                freqs[j] = FREQS[d % half];
            }
        }
    }
    let vsrc = base + P.v_offset + g * D;
    if !is_q {
        for (var j = 0u; j < PER_LANE_V; j++) {
            let w = ids.lid + j * {{WG}}u;
            if w < D / 2u {
                vs[j] = vec2<f32>(PROJ[vsrc + 2u * w], PROJ[vsrc + 2u * w + 1u]);
            }
        }
    }
    var sq = 0.0;
    for (var j = 0u; j < PER_LANE_D; j++) {
        if ids.lid + j * {{WG}}u < D {
            sq += xs[j] * xs[j];
        }
    }
    let inv = inverseSqrt(wg_sum(sq, ids) / f32(D) + P.eps);
    for (var j = 0u; j < PER_LANE_D; j++) {
        let d = ids.lid + j * {{WG}}u;
        if d < D {
            vals[d] = xs[j] * inv * ws[j];
        }
    }
    workgroupBarrier();
    var rotated: array<f32, PER_LANE_D>;
    for (var j = 0u; j < PER_LANE_D; j++) {
        let d = ids.lid + j * {{WG}}u;
        if d < D {
            var y = vals[d];
            if d < P.n_rot {
                let angle = f32(pos) * freqs[j];
                let k = round(angle / TWO_PI);
                let reduced = (angle - k * TWO_PI_HEAD) - k * TWO_PI_TAIL;
                let c = cos(reduced);
                let s = sin(reduced);
                if d < half {
                    y = vals[d] * c - vals[d + half] * s;
                } else {
                    y = vals[d - half] * s + vals[d] * c;
                }
            }
            rotated[j] = y;
        }
    }
    if is_q {
        // Each invocation stores its own elements: no exchange, so no further barrier.
        let out = P.q_out_offset + r * P.q_out_row_stride + item * D;
        for (var j = 0u; j < PER_LANE_D; j++) {
            let d = ids.lid + j * {{WG}}u;
            if d < D {
                Q_OUT[out + d] = rotated[j];
            }
        }
        return;
    }
    workgroupBarrier();
    for (var j = 0u; j < PER_LANE_D; j++) {
        let d = ids.lid + j * {{WG}}u;
        if d < D {
            vals[d] = rotated[j];
        }
    }
    workgroupBarrier();
    let cell = (local * P.ctx + pos) * P.kv_heads + g;
    let kw = cell * K_ROW;
#if K_TYPE == 0
    for (var d = ids.lid; d < D; d += {{WG}}u) {
        K_CACHE[kw + d] = vals[d];
    }
#endif
#if K_TYPE == 1
    for (var w = ids.lid; w < D / 2u; w += {{WG}}u) {
        K_CACHE[kw + w] = pack2x16float(vec2<f32>(vals[2u * w], vals[2u * w + 1u]));
    }
#endif
#if K_TYPE == 2
    for (var b = ids.lid; b < D / 32u; b += {{WG}}u) {
        var amax = 0.0;
        for (var i = 0u; i < 32u; i++) {
            amax = max(amax, abs(vals[32u * b + i]));
        }
        block_scale[b] = amax / 127.0;
    }
    workgroupBarrier();
    for (var w = ids.lid; w < D / 4u; w += {{WG}}u) {
        let d = block_scale[w / 8u];
        let id = select(0.0, 1.0 / d, d != 0.0);
        let x = vec4<f32>(vals[4u * w], vals[4u * w + 1u], vals[4u * w + 2u], vals[4u * w + 3u]);
        K_CACHE[kw + w] = pack4xI8(vec4<i32>(round(x * id)));
    }
    // The scales as f16 pairs after the quants (an odd count leaves the last high half 0).
    for (var w = ids.lid; w < (D / 32u + 1u) / 2u; w += {{WG}}u) {
        let hi = select(0.0, block_scale[2u * w + 1u], 2u * w + 1u < D / 32u);
        K_CACHE[kw + D / 4u + w] = pack2x16float(vec2<f32>(block_scale[2u * w], hi));
    }
#endif
    let vw = cell * V_ROW;
    for (var j = 0u; j < PER_LANE_V; j++) {
        let w = ids.lid + j * {{WG}}u;
        if w < D / 2u {
#if V_TYPE == 0
            V_CACHE[vw + 2u * w] = vs[j].x;
            V_CACHE[vw + 2u * w + 1u] = vs[j].y;
#else
            V_CACHE[vw + w] = pack2x16float(vs[j]);
#endif
        }
    }
}
#endif
