// Cooperative-matrix mat-mat for prefill (tensor cores where wgpu's experimental cooperative-matrix
// feature exists): Y[:, n] = W · X[:, n], W in any ggml type, X and Y f32 column-major as in
// matmul.wgsl, dense or grouped by expert (MOE, common_matmul.wgsl). A workgroup of SGS subgroups
// (SG lanes each) computes a TM (rows) × TN (columns) tile; subgroup s owns the WM × WN block
// (s mod TM/WM, s div TM/WM) as AM × AN accumulators of F×F. Per TK-wide K step (32 or 64; KK =
// TK / F) the workgroup dequantises its W rows to f16 and converts its X columns to f16 in
// workgroup memory, then each subgroup runs KK × AM × AN multiply-adds. A split-K dispatch
// (common_matmul.wgsl) walks its workgroup's K range only. Accumulators are ACC (f32 where the device offers
// f16×f16→f32, else f16). Inputs in f16 lose precision (11-bit mantissa) and range (|x| ≤ 65504):
// the tests state the tolerance. K not a multiple of 32 is zero-padded in the tile. Each output is
// the same chain of multiply-adds whatever the tile shape or grouping, so a row's result does not
// depend on which tile or call computes it, nor on TK (the same F-wide chain either way).
//
// Decode's fused stages (dense, unsplit; matvec.wgsl's PRE and EPI, bindings from 3 in the order
// NORM or SQ, RES, CONV_W, STATE, SLOTS): PRE=rms normalises each column on the fly (its norm
// weights multiply X as the tile is filled, its scale 1/sqrt(mean(x²) + eps) multiplies the
// finished products, from sums of squares taken from the same loads); PRE=head_rms scales head h of
// column c by 1/sqrt(S/head dim + eps), S from sums an earlier kernel wrote; EPI=add stores RES + y,
// EPI=conv runs the GDN conv1d + SiLU on the rows below P.conv_rows and advances each column's slot
// state. The tensor-core form of the decode step's dense products when several slots step together.
//
// F is the matrices' size, 16 or 8 (naga's WGSL has square 8×8 and 16×16 matrices): 16×16×16 f16
// is what Vulkan drivers with tensor cores offer; 8×8×8 is the runtime's choice only where the
// adapter offers no 16 (Mesa's lavapipe; Metal's simdgroup matrices are 8×8 too, but the runtime
// takes F = 8 on Vulkan only). The result's chain is then 8-wide: another summation order, on
// another device.
enable f16;
enable wgpu_cooperative_matrix;
#include "common.wgsl"
#include "common_dequant.wgsl"
#include "common_matmul.wgsl"
#if PRE == head_rms
#include "common_head_rms.wgsl"
#endif
#include "common_epilogue.wgsl"
#define QTYPE q8_0
#define SG 32
#define F 16
#define ACC f32
#define TM 64
#define TN 64
#define WM 32
#define WN 32
#define AM 2
#define AN 2
#define SGS 4
#define MOE 0
#define TK 32
#define KK 2
// Per-invocation loop counts of one K step's fill (X vec4, IQ4_XS rows), passed in so the
// loops unroll (`#for`) and their arrays stay in registers; checked against the tile below.
#define XH 4
#define WPT 2
#define PRE none
#define EPI store
#define HEADS 32
#define HD4 32
#define B_NORM 3
#define B_SQ 3
#define B_RES 3
#define B_CW 3
#define B_ST 4
#define B_SL 5
#variants QTYPE=f32
#variants QTYPE=f16
#variants QTYPE=bf16
#variants QTYPE=q4_0
#variants QTYPE=q4_k
#variants QTYPE=q5_k
#variants QTYPE=q6_k
#variants QTYPE=iq4_nl
#variants QTYPE=iq4_xs ACC=f16
#variants QTYPE=iq4_xs TM=128 TN=128 WM=64 WN=32 AM=4 AN=2 SGS=8
#variants QTYPE=q6_k TM=128 TN=64 WM=64 WN=32 AM=4 AN=2 SGS=4
#variants QTYPE=iq4_xs TM=128 TN=16 WM=32 WN=16 AM=2 AN=1 SGS=4 MOE=1 XH=1 WPT=4
#variants QTYPE=iq4_xs TM=128 TN=16 WM=32 WN=16 AM=2 AN=1 SGS=4 XH=1 WPT=4
#variants QTYPE=q8_0 TM=128 TN=16 WM=32 WN=16 AM=2 AN=1 SGS=4 MOE=1 ACC=f16 XH=1
#variants QTYPE=iq4_xs TM=128 TN=16 WM=32 WN=16 AM=2 AN=1 SGS=4 MOE=1 TK=64 KK=4 XH=2 WPT=8
#variants QTYPE=iq4_xs TM=128 TN=64 WM=64 WN=32 AM=4 AN=2 SGS=4 MOE=1 WPT=4
#variants QTYPE=q8_0 TM=128 TN=64 WM=64 WN=32 AM=4 AN=2 SGS=4 MOE=1 ACC=f16 TK=64 KK=4 XH=8 WPT=2
#variants QTYPE=iq4_xs TM=128 TN=128 WM=64 WN=32 AM=4 AN=2 SGS=8 TK=64 KK=4 XH=8 WPT=4
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
#variants QTYPE=iq4_xs TM=128 TN=64 WM=32 WN=32 AM=2 AN=2 SGS=8 MOE=1 XH=2
#variants QTYPE=iq4_xs F=8 SG=8 AM=4 AN=4 KK=4 XH=16 WPT=8
#variants QTYPE=q6_k F=8 SG=8 AM=4 AN=4 KK=4 XH=16
#variants QTYPE=iq4_xs TM=128 TN=16 WM=32 WN=16 AM=2 AN=1 SGS=4 XH=1 WPT=4 PRE=rms EPI=conv B_NORM=3 B_CW=4 B_ST=5 B_SL=6
#variants QTYPE=q8_0 TM=128 TN=16 WM=32 WN=16 AM=2 AN=1 SGS=4 XH=1 PRE=head_rms EPI=add B_SQ=3 B_RES=4
#variants QTYPE=iq4_xs TM=128 TN=16 WM=32 WN=16 AM=4 AN=2 SGS=4 F=8 SG=8 KK=4 XH=4 WPT=16 PRE=rms

// Row pitch of the f16 tiles in halves: TK + 8 keeps every F×F load 16-byte aligned (80- or
// 144-byte rows) while shifting successive rows across memory banks (LDM, TM + 8, likewise).
const LD = {{TK}}u + 8u;
const THREADS = {{SGS}}u * {{SG}}u;
// Subgroup blocks along the rows of the tile.
const SG_ROWS = {{TM}}u / {{WM}}u;
// 8-weight groups and X vec4 per row / column and K step.
const WG8 = {{TK}}u / 8u;
const XK4 = {{TK}}u / 4u;
// X vec4 loads per invocation and K step.
const XH = {{XH}}u;
const_assert XH == ({{TN}}u * XK4 + THREADS - 1u) / THREADS;

#if QTYPE == iq4_xs
// IQ4_XS tiles are k-major: a warp's f16 stores of one weight index land in neighbouring halves
// (row-major, rows LD apart fell in 8 banks: 4-way conflicts).
const LDM = {{TM}}u + 8u;
var<workgroup> w_tile: array<f16, {{TK}} * ({{TM}} + 8)>; // TK × LDM, (k, m)
#else
var<workgroup> w_tile: array<f16, {{TM}} * ({{TK}} + 8)>; // TM × LD, row-major (m, k)
#endif
var<workgroup> x_tile: array<f16, {{TN}} * ({{TK}} + 8)>; // TN × LD, column n holds its k contiguous
#if PRE == rms
@group(0) @binding({{B_NORM}}) var<storage, read> NORM: array<vec4<f32>>;
// The invocations' sums of squares (entry t + THREADS·h: column entry / XK4), then the columns' scales.
var<workgroup> sq_tile: array<f32, {{TN}} * ({{TK}} / 4)>;
var<workgroup> col_scale: array<f32, {{TN}}>;
#endif
#if PRE == head_rms
@group(0) @binding({{B_SQ}}) var<storage, read> SQ: array<f32>;
var<workgroup> head_inv: array<f32, {{TN}} * {{HEADS}}>;
#endif
#if EPI == add
@group(0) @binding({{B_RES}}) var<storage, read> RES: array<f32>;
#endif
#if EPI == conv
@group(0) @binding({{B_CW}}) var<storage, read> CONV_W: array<f32>;
@group(0) @binding({{B_ST}}) var<storage, read_write> STATE: array<f32>;
@group(0) @binding({{B_SL}}) var<storage, read> SLOTS: array<u32>;
#endif

// One F×F accumulator per subgroup on its way out, column-major, so edge tiles clip per element.
const FF = {{F}}u * {{F}}u;
var<workgroup> c_stage: array<{{ACC}}, {{SGS}} * {{F}} * {{F}}>;

#if QTYPE == iq4_xs
// The fill reads quant words the way memory lays them out: invocation t takes word j = t mod QW of
// its rows' QW words per K step (a K step's quants are contiguous in a row's block), so a warp's
// load covers 32/QW rows' consecutive words (8 segments of 16 bytes at TK 32) where one row per
// invocation touched 32 rows per load (H200: the grouped MoE product at 2048 tokens 3.8 → 3.0 ms).
// Rows r0 + ROW_STEP·i, i < WPT, are the invocation's, the same every K step, so each row's block
// header (f16 d, u16 scales_h; scales_l) stays in registers and is read once per 256 weights.
const QW = {{TK}}u / 8u;
const ROW_STEP = THREADS / QW;
const WPT = {{WPT}}u;
const_assert WPT == ({{TM}}u + ROW_STEP - 1u) / ROW_STEP;
// kvalues_iq4nl (integers, exact in f16): one shared load per weight where dq8_iq4_xs runs a
// select chain.
var<workgroup> iq4_table: array<f16, 16>;

// Row (of the tile) `i` of invocation t: the same rows at the prefetch and at the fill.
fn iq4_row(t: u32, i: u32) -> u32 {
    return t / QW + ROW_STEP * i;
}

// One row's registers: its block header (reloaded where a block starts) and this K step's word.
struct Iq4Word {
    head: u32,
    lows: u32,
    q: u32,
}

// This invocation's words of K step k0 (a row past the end keeps zeros: d = 0 stores zeros). The
// header is read at the first step of each block and of the K range.
fn prefetch_w(w_next: ptr<function, array<Iq4Word, WPT>>, tile: ColTile, m0: u32, k0: u32, k_first: u32,
    t: u32) {
    let new_block = (k0 & 255u) == 0u || k0 == k_first;
#for ii in 0..WPT
    {
        let row = iq4_row(t, {{ii}}u);
        if row < {{TM}}u && m0 + row < P.rows {
            let blk = (tile.w_base + (m0 + row) * P.row_bytes + 136u * (k0 >> 8u)) / 4u;
            if new_block {
                (*w_next)[{{ii}}].head = W[blk];
                (*w_next)[{{ii}}].lows = W[blk + 1u];
            }
            (*w_next)[{{ii}}].q = W[blk + 2u + ((k0 & 255u) >> 3u) + t % QW];
        }
    }
#endfor
}

// Row `row`'s word of K step k0 into w_tile: word j holds quant bytes 4(j mod 4)..+3 of sub-block
// (k0 mod 256)/32 + j/4, whose low nibbles are weights 4(j mod 4) + b and high nibbles
// 16 + 4(j mod 4) + b of the sub-block. Byte b goes in store (b + j/2) mod 4: the warp's eight (or
// four) words of one store then land in distinct bank groups of the k-major tile. The sub-block
// scale is rounded to f16 and the products taken in f16, two weights per multiply: an f32 product
// and its conversion per weight made the fill the MoE products' bottleneck (H200: 2.32 → 2.07 ms
// at 512 tokens). A weight is then f16(f16(d·(ls − 32))·q), within about one f16 ulp of the exact
// value where dq8's f16(d·(ls − 32)·q) is within half of one (coop NMSE ~1e-7 against f64).
fn store_iq4_xs(v: Iq4Word, k0: u32, j: u32, row: u32) {
    let ib = ((k0 & 255u) >> 5u) + j / 4u;
    let sl = (v.lows >> (8u * (ib >> 1u))) & 0xffu;
    let ls = ((sl >> (4u * (ib & 1u))) & 15u) | (((v.head >> (16u + 2u * ib)) & 3u) << 4u);
    let dl = unpack2x16float(v.head).x * (f32(ls) - 32.0);
    let at = (32u * (j / 4u) + 4u * (j % 4u)) * LDM + row;
    let dl16 = f16(dl);
#for bb in 0..4
    {
        let b = ({{bb}}u + j / 2u) & 3u;
        let byte = v.q >> (8u * b);
        let pair = vec2<f16>(iq4_table[byte & 15u], iq4_table[(byte >> 4u) & 15u]) * dl16;
        w_tile[at + b * LDM] = pair.x;
        w_tile[at + (16u + b) * LDM] = pair.y;
    }
#endfor
}
#endif

// This invocation's X values of K step k0 (zero outside the tile's columns or K).
fn prefetch(x_next: ptr<function, array<vec4<f32>, XH>>, x_start: ptr<function, array<u32, XH>>, tile: ColTile,
    k0: u32, t: u32) {
#for hh in 0..XH
    {
        let h = {{hh}}u;
        let e = t + THREADS * h;
        let xn = e / XK4;
        let xk4 = e % XK4;
        var v = vec4<f32>(0.0);
        if xn < tile.cols && k0 + 4u * xk4 < P.k {
            v = X[((*x_start)[h] + k0) / 4u + xk4];
        }
        (*x_next)[h] = v;
    }
#endfor
}

@compute @workgroup_size({{SGS}} * {{SG}})
fn main(ids: ComputeIds) {
    let m0 = ids.wid.x * {{TM}}u;
    let t = ids.lid;
#if QTYPE == iq4_xs
    if t < 16u {
        iq4_table[t] = f16(kv_iq4nl4(vec4<u32>(t)).x);
    }
    workgroupBarrier();
#endif
    col_tile_read(t, ids.wid.y, {{TN}}u);
    let tile = col_tile();
    // Not an early return: naga wants cooperative-matrix operations in control flow that no
    // return has left, even a uniform one.
    if tile.cols > 0u {
        let sl = subgroup_lane(ids, {{SG}}u);
        let sg = sl.x;
        let lane = sl.y;
        let sm = {{WM}}u * (sg % SG_ROWS);
        let sn = {{WN}}u * (sg / SG_ROWS);
        let groups = P.k / 8u;
        // Where this invocation's X loads start: the same columns every K step, so found once (a
        // grouped tile's column comes from the sorted entries, a dependent read per step otherwise).
        var x_start: array<u32, XH>;
#for hh in 0..XH
        {
            let h = {{hh}}u;
            let xn = (t + THREADS * h) / XK4;
            if xn < tile.cols {
                x_start[h] = x_col_start(tile, xn);
            }
        }
#endfor
#for a in 0..AM
#for b in 0..AN
        var acc{{a}}{{b}}: coop_mat{{F}}x{{F}}<{{ACC}}, C>;
#endfor
#endfor
#if PRE == rms
        var sq_acc: array<f32, XH>;
#endif
#if PRE == head_rms
        for (var i = t; i < {{TN}}u * {{HEADS}}u; i += THREADS) {
            let c = i / {{HEADS}}u;
            if c < tile.cols {
                head_inv[i] = head_rms_inv(tile.first + c, i % {{HEADS}}u);
            }
        }
        workgroupBarrier();
#endif
        let kr = k_range(ids.wid.z);
        // The next K step's global reads, issued before this step's MMAs (software pipelining: a
        // step's loads are in flight while the tensor cores work), stored to the tiles at its top.
        var x_next: array<vec4<f32>, XH>;
#if QTYPE == iq4_xs
        var w_next: array<Iq4Word, WPT>;
#endif
        for (var k0 = kr.x; k0 < kr.y; k0 += {{TK}}u) {
            if k0 == kr.x {
                prefetch(&x_next, &x_start, tile, k0, t);
#if QTYPE == iq4_xs
                prefetch_w(&w_next, tile, m0, k0, kr.x, t);
#endif
            }
#if QTYPE == iq4_xs
            // W: each of this invocation's rows' word (K is a multiple of 256 for IQ4_XS, so a
            // K step is all in or all out, as dq8's groups of 8 would be).
#for ii in 0..WPT
            {
                let row = iq4_row(t, {{ii}}u);
                if row < {{TM}}u {
                    store_iq4_xs(w_next[{{ii}}], k0, t % QW, row);
                }
            }
#endfor
#else
            // W: TM rows × WG8 groups of 8 weights; neighbouring invocations take neighbouring groups.
            for (var e = t; e < {{TM}}u * WG8; e += THREADS) {
                let row = e / WG8;
                let grp = e % WG8;
                let g = k0 / 8u + grp;
                var w = W8(vec4<f32>(0.0), vec4<f32>(0.0));
                if m0 + row < P.rows && g < groups {
                    w = dq8_{{QTYPE}}(tile.w_base + (m0 + row) * P.row_bytes, g);
                }
                let at = row * LD + 8u * grp;
#for i in 0..4
                w_tile[at + {{i}}u] = f16(w.a[{{i}}]);
                w_tile[at + 4u + {{i}}u] = f16(w.b[{{i}}]);
#endfor
            }
#endif
            // X: TN columns × XK4 vec4 of K, from the prefetched registers.
#for hh in 0..XH
            {
                let h = {{hh}}u;
                let e = t + THREADS * h;
                let xn = e / XK4;
                let xk4 = e % XK4;
                if xn < {{TN}}u {
                    var v = x_next[h];
#if PRE == rms
                    sq_acc[h] += dot(v, v);
                    if k0 + 4u * xk4 < P.k {
                        v *= NORM[k0 / 4u + xk4];
                    }
#endif
#if PRE == head_rms
                    if xn < tile.cols {
                        v *= head_inv[xn * {{HEADS}}u + (k0 / 4u + xk4) / {{HD4}}u];
                    }
#endif
                    let at = xn * LD + 4u * xk4;
#for i in 0..4
                    x_tile[at + {{i}}u] = f16(v[{{i}}]);
#endfor
                }
            }
#endfor
            workgroupBarrier();
            // The prefetch writes registers only: no barrier between it and the MMAs.
            if k0 + {{TK}}u < kr.y {
                prefetch(&x_next, &x_start, tile, k0 + {{TK}}u, t);
#if QTYPE == iq4_xs
                prefetch_w(&w_next, tile, m0, k0 + {{TK}}u, kr.x, t);
#endif
            }
#for kk in 0..KK
            {
#for a in 0..AM
#if QTYPE == iq4_xs
                let a{{a}} = coopLoad<coop_mat{{F}}x{{F}}<f16, A>>(&w_tile[{{F}}u * {{kk}}u * LDM + sm + {{F}}u * {{a}}u], LDM);
#else
                let a{{a}} = coopLoadT<coop_mat{{F}}x{{F}}<f16, A>>(&w_tile[(sm + {{F}}u * {{a}}u) * LD + {{F}}u * {{kk}}u], LD);
#endif
#endfor
#for b in 0..AN
                let b{{b}} = coopLoad<coop_mat{{F}}x{{F}}<f16, B>>(&x_tile[(sn + {{F}}u * {{b}}u) * LD + {{F}}u * {{kk}}u], LD);
#endfor
#for a in 0..AM
#for b in 0..AN
                acc{{a}}{{b}} = coopMultiplyAdd(a{{a}}, b{{b}}, acc{{a}}{{b}});
#endfor
#endfor
            }
#endfor
            workgroupBarrier();
        }
#if PRE == rms
        // Column c's sum of squares: its XK4 entries in order.
#for hh in 0..XH
        {
            let e = t + THREADS * {{hh}}u;
            if e < {{TN}}u * XK4 {
                sq_tile[e] = sq_acc[{{hh}}];
            }
        }
#endfor
        workgroupBarrier();
        if t < {{TN}}u {
            var sum = 0.0;
            for (var j = 0u; j < XK4; j++) {
                sum += sq_tile[t * XK4 + j];
            }
            col_scale[t] = inverseSqrt(sum / f32(P.k) + P.eps);
        }
        workgroupBarrier();
#endif
        // Each accumulator through the subgroup's staging block, then out by its lanes with clipping.
        let stage = sg * FF;
#for a in 0..AM
#for b in 0..AN
        coopStore(acc{{a}}{{b}}, &c_stage[stage], {{F}}u);
        workgroupBarrier();
        for (var e = lane; e < FF; e += {{SG}}u) {
            let m = m0 + sm + {{F}}u * {{a}}u + e % {{F}}u;
            let n = sn + {{F}}u * {{b}}u + e / {{F}}u;
            if m < P.rows && n < tile.cols {
                var y = f32(c_stage[stage + e]);
#if PRE == rms
                y *= col_scale[n];
#endif
                store_out(y_col_start(tile, n, ids.wid.z) + m, m, tile.first + n, y);
            }
        }
        workgroupBarrier();
#endfor
#endfor
    }
}
