// Cooperative-matrix flash attention for prefill pieces over an f16 K/V cache (tensor cores where
// wgpu's experimental cooperative-matrix feature exists). It writes the partials of attention.wgsl's
// OP=prefill — the same grid (splits, kv heads, query tiles), tiles of TT tokens × the GQA group's G
// heads, split plan and layouts — and that file's OP=merge normalises and gates them. Layouts and
// the host side: rust/ops/attention.rs.
//
// A workgroup of 8 subgroups takes one tile of BR = 64 rows (TT = 64 / G tokens; rows past TT·G or
// the piece are zero and never written) and walks its split's keys in blocks of BC = 32 staged in
// workgroup memory as f16. Subgroup s owns rows 16·(s mod 4)..+16: for the scores S = q·Kᵀ it
// computes the 16 keys (s div 4) of each block, for the output the dims D/2·(s div 4)..+D/2, with q
// held as A matrices for the whole walk. The matrices are F×F, F = 16 (tensor cores) or 8 (an
// adapter with only 8×8×8, e.g. lavapipe: each 16-wide block is then R × R of them). The online softmax needs a per-row rescale of the output
// that cooperative matrices cannot do in place, so the walk is made twice: the first pass finds
// each row's max m over its visible keys, the second accumulates o = Σ exp(s − m)·v and
// l = Σ exp(s − m) with m fixed (scores cost twice, the output never moves). Inputs to the
// multiply-adds are f16 (q, the cache's own K and V, the weights p ∈ [0, 1]), accumulators f32,
// the scale and the exponentials f32: the precision of llama.cpp's tensor-core flash attention, and
// what the tests state. A row's result depends on its own q and its split only (each output is its
// own chain of F-wide multiply-adds), never on the other rows of its tile.
enable f16;
enable wgpu_cooperative_matrix;
#include "common.wgsl"
#include "common_attention.wgsl"
#define HEAD_DIM 256
#define GROUP 8
#define SG 32
#define F 16
// 16-wide blocks per F (16 / F), F-wide chunks in half a head row (HEAD_DIM / 2F) and in a block
// of keys (32 / F).
#define R 1
#define DF 8
#define KB 2
#variants HEAD_DIM=64 GROUP=2 DF=2
#variants HEAD_DIM=32 GROUP=3 DF=1
#variants HEAD_DIM=64 GROUP=2 F=8 SG=8 R=2 DF=4 KB=4
#variants HEAD_DIM=256 F=8 SG=8 R=2 DF=16 KB=4

const D: u32 = {{HEAD_DIM}}u;
const G: u32 = {{GROUP}}u;
const BR: u32 = 64u;
const TT: u32 = BR / G;
const BC: u32 = 32u;
const THREADS: u32 = 8u * {{SG}}u;
// Invocations per row in the softmax passes, and the keys of a block each scans.
const PARTS: u32 = THREADS / BR;
const KP: u32 = BC / PARTS;
const_assert PARTS >= 1u && PARTS * BR == THREADS && KP * PARTS == BC;
const_assert {{R}}u * {{F}}u == 16u && {{DF}}u * {{F}}u == HALF && {{KB}}u * {{F}}u == BC;
const HALF: u32 = D / 2u;
// Pitches in halves: rows 16-byte aligned and shifted across memory banks.
const LDK: u32 = D + 8u;
const LDQ: u32 = HALF + 8u;
const LDP: u32 = BC + 8u;

var<immediate> P: CoreParams;
// The bindings of attention.wgsl's split ops (one dispatch path on the host); a piece's rows are
// (slot, pos + r) from the immediates, so ROWS is not read.
@group(0) @binding(0) var<storage, read> ROWS: array<u32>;
@group(0) @binding(1) var<storage, read> Q: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> K_CACHE: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> V_CACHE: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read_write> PART_O: array<f32>;
@group(0) @binding(5) var<storage, read_write> PART_ML: array<vec2<f32>>;

// The staged K or V block (BC keys × D, pitch LDK), or half of the tile's q (BR rows × HALF, pitch
// LDQ; the larger of the two).
var<workgroup> kvq: array<f16, BR * LDQ>;
// Scores of a block as [key][row] (f32); at the end each subgroup's output blocks on their way out.
var<workgroup> s_tile: array<f32, BC * BR>;
// Weights of a block as [row][key] (f16), the A operand of the output's multiply-adds.
var<workgroup> p_tile: array<f16, BR * LDP>;
// Per-row partial maxima / sums of the PARTS invocations sharing a row, and the rows' maxima.
var<workgroup> row_part: array<f32, PARTS * BR>;
var<workgroup> row_max: array<f32, BR>;
// (live, first key, end key, first token) of this workgroup's tile and split.
var<workgroup> tile_wg: vec4<u32>;

// Half h of q for the tile's rows into kvq: row i is token t_first + i / G, head g·G + i mod G.
fn stage_q(h: u32, t_first: u32, g: u32, t: u32) {
    for (var e = t; e < BR * HALF / 4u; e += THREADS) {
        let i = e / (HALF / 4u);
        let c4 = e % (HALF / 4u);
        let tok = t_first + i / G;
        var v = vec4<f32>(0.0);
        if i < TT * G && tok < P.rows {
            v = Q[(P.q_offset + tok * P.q_row_stride + (g * G + i % G) * D + h * HALF) / 4u + c4];
        }
        let at = i * LDQ + 4u * c4;
        kvq[at] = f16(v.x);
        kvq[at + 1u] = f16(v.y);
        kvq[at + 2u] = f16(v.z);
        kvq[at + 3u] = f16(v.w);
    }
}

// Keys k0..k0+BC of kv head g (V when `values`) into kvq; keys from `end` on repeat key end - 1 (a
// real row, so finite; its weight is 0).
fn stage_block(k0: u32, end: u32, local: u32, g: u32, t: u32, values: bool) {
    for (var e = t; e < BC * D / 8u; e += THREADS) {
        let key = e / (D / 8u);
        let u = e % (D / 8u);
        let word = ((local * P.ctx + min(k0 + key, end - 1u)) * P.kv_heads + g) * HALF;
        var w: vec4<u32>;
        if values {
            w = V_CACHE[word / 4u + u];
        } else {
            w = K_CACHE[word / 4u + u];
        }
        let at = key * LDK + 8u * u;
#for i in 0..4
        {
            let pair = unpack2x16float(w[{{i}}]);
            kvq[at + 2u * {{i}}u] = f16(pair.x);
            kvq[at + 2u * {{i}}u + 1u] = f16(pair.y);
        }
#endfor
    }
}

@compute @workgroup_size(8 * {{SG}})
fn main(ids: ComputeIds) {
    let t = ids.lid;
    if t == 0u {
        let t_first = ids.wid.z * TT;
        var v = vec4<u32>(0u);
        if t_first < P.rows {
            // The tile's keys: through its last token's own position (attention.wgsl's tile_keys).
            let n = P.pos + min(t_first + TT, P.rows);
            let pl = plan(n);
            if ids.wid.x < pl.y {
                let start = ids.wid.x * pl.x;
                v = vec4<u32>(1u, start, min(start + pl.x, n), t_first);
            }
        }
        tile_wg = v;
    }
    // Not an early return: naga wants cooperative-matrix operations in control flow that no return
    // has left, and the tile read through workgroupUniformLoad is uniform in its eyes.
    let tile = workgroupUniformLoad(&tile_wg);
    if tile.x != 0u {
        let split = ids.wid.x;
        let g = ids.wid.y;
        let start = tile.y;
        let end = tile.z;
        let t_first = tile.w;
        let local = P.slot - P.first_slot;
        let sl = subgroup_lane(ids, {{SG}}u);
        let sg = sl.x;
        let lane = sl.y;
        let rb = sg % 4u;
        let side = sg / 4u;
        // The row this invocation scans in the softmax passes (PARTS per row, KP keys of a block
        // each); its keys through its own position are visible.
        let row = t % BR;
        let part = t / BR;
        let own = P.pos + t_first + row / G;

        stage_q(0u, t_first, g, t);
        workgroupBarrier();
#for i in 0..R
#for c in 0..DF
        let qa{{i}}_{{c}} = coopLoadT<coop_mat{{F}}x{{F}}<f16, A>>(&kvq[(16u * rb + {{F}}u * {{i}}u) * LDQ + {{F}}u * {{c}}u], LDQ);
#endfor
#endfor
        workgroupBarrier();
        stage_q(1u, t_first, g, t);
        workgroupBarrier();
#for i in 0..R
#for c in 0..DF
        let qb{{i}}_{{c}} = coopLoadT<coop_mat{{F}}x{{F}}<f16, A>>(&kvq[(16u * rb + {{F}}u * {{i}}u) * LDQ + {{F}}u * {{c}}u], LDQ);
#endfor
#endfor

        var mx = MASKED;
        // Pass 0 finds each row's max m over its visible keys; pass 1 accumulates o = Σ p·v and
        // l = Σ p with p = exp(s − m), the weights rounded to f16 once and summed as rounded, so l
        // is the sum of what multiplies v. Both compute a block's scores the same way.
#for PASS in 0..2
        for (var k0 = start; k0 < end; k0 += BC) {
            workgroupBarrier();
            stage_block(k0, end, local, g, t, false);
            workgroupBarrier();
            // Rows 16·rb + F·i, keys 16·side + F·j of the block.
#for i in 0..R
#for j in 0..R
            {
                var s: coop_mat{{F}}x{{F}}<f32, C>;
                let kj = (16u * side + {{F}}u * {{j}}u) * LDK;
#for c in 0..DF
                s = coopMultiplyAdd(qa{{i}}_{{c}}, coopLoad<coop_mat{{F}}x{{F}}<f16, B>>(&kvq[kj + {{F}}u * {{c}}u], LDK), s);
                s = coopMultiplyAdd(qb{{i}}_{{c}}, coopLoad<coop_mat{{F}}x{{F}}<f16, B>>(&kvq[kj + HALF + {{F}}u * {{c}}u], LDK), s);
#endfor
                coopStore(s, &s_tile[(16u * side + {{F}}u * {{j}}u) * BR + 16u * rb + {{F}}u * {{i}}u], BR);
            }
#endfor
#endfor
            workgroupBarrier();
#if PASS == 0
            for (var j = 0u; j < KP; j++) {
                let key = k0 + KP * part + j;
                if key < end && key <= own {
                    mx = max(mx, s_tile[(KP * part + j) * BR + row] * P.scale);
                }
            }
#else
            for (var j = 0u; j < KP; j++) {
                let key = k0 + KP * part + j;
                var p = f16(0.0);
                if key < end && key <= own {
                    p = f16(exp(s_tile[(KP * part + j) * BR + row] * P.scale - m));
                }
                l += f32(p);
                p_tile[row * LDP + KP * part + j] = p;
            }
            stage_block(k0, end, local, g, t, true);
            workgroupBarrier();
#for kk in 0..KB
#for i in 0..R
            {
                let pa = coopLoadT<coop_mat{{F}}x{{F}}<f16, A>>(&p_tile[(16u * rb + {{F}}u * {{i}}u) * LDP + {{F}}u * {{kk}}u], LDP);
#for c in 0..DF
                o{{i}}_{{c}} = coopMultiplyAdd(pa, coopLoadT<coop_mat{{F}}x{{F}}<f16, B>>(&kvq[({{F}}u * {{kk}}u) * LDK + side * HALF + {{F}}u * {{c}}u], LDK), o{{i}}_{{c}});
#endfor
            }
#endfor
#endfor
#endif
        }
#if PASS == 0
        row_part[part * BR + row] = mx;
        workgroupBarrier();
        if part == 0u {
            var rm = row_part[row];
            for (var q = 1u; q < PARTS; q++) {
                rm = max(rm, row_part[q * BR + row]);
            }
            row_max[row] = rm;
        }
        workgroupBarrier();
        let m = row_max[row];
        var l = 0.0;
#for i in 0..R
#for c in 0..DF
        var o{{i}}_{{c}}: coop_mat{{F}}x{{F}}<f32, C>;
#endfor
#endfor
#endif
#endfor
        workgroupBarrier();
        row_part[part * BR + row] = l;
        workgroupBarrier();
        let tok = t_first + row / G;
        if part == 0u && row < TT * G && tok < P.rows {
            // In order of the parts, as the sum ((a + b) + c) + d.
            var total = row_part[row];
            for (var q = 1u; q < PARTS; q++) {
                total += row_part[q * BR + row];
            }
            PART_ML[part_index(tok, g * G + row % G, split)] = vec2<f32>(m, total);
        }
        // Each output block through the subgroup's F×F of s_tile, then out a row's F dims at a time.
        let stage = sg * {{F}}u * {{F}}u;
#for i in 0..R
#for c in 0..DF
        coopStore(o{{i}}_{{c}}, &s_tile[stage], {{F}}u);
        workgroupBarrier();
        for (var e = lane; e < {{F}}u * {{F}}u; e += {{SG}}u) {
            let r = 16u * rb + {{F}}u * {{i}}u + e / {{F}}u;
            let rt = t_first + r / G;
            if r < TT * G && rt < P.rows {
                PART_O[part_index(rt, g * G + r % G, split) * D + side * HALF + {{F}}u * {{c}}u + e % {{F}}u] =
                    s_tile[stage + (e % {{F}}u) * {{F}}u + e / {{F}}u];
            }
        }
        workgroupBarrier();
#endfor
#endfor
    }
}
