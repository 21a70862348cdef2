// Dequantisation of ggml weight blocks read from `W: array<u32>` (declared by the including kernel:
// WGSL has no u8 storage). `dq8_<type>(row, g)` returns weights 8g..8g+7 of the row that starts at
// byte `row` of W. Block layouts and formulas: docs/numerics.md "GGUF block formats"
// (ggml-common.h). Rows may
// start at any byte (MXFP4 blocks are 17 bytes, Q6_K 210, Q8_0 34), so reads go through w_u32_at,
// which funnels two words when the offset is not 4-aligned; types whose block size is a multiple of
// 4 read fields with w_u32_al. Every type qk reads has its dq8 (<type> = rust/ops/matmul.rs
// qtype_name), with rust/gguf/dequant.rs's products. The IQ1/IQ2/IQ3 types also read their grid
// from the end of the W binding (iq_grid), so kernels bind whole weight windows.

struct W8 {
    a: vec4<f32>,
    b: vec4<f32>,
}

// Branch-free: invocations of one subgroup see both alignments (blocks of 34 bytes alternate), and
// a branch would run both sides. `(next << 1) << (31 - s)` is `next << (32 - s)` without the
// undefined 32-bit shift at s = 0 (it yields 0 there).
fn w_u32_at(byte: u32) -> u32 {
    let i = byte >> 2u;
    let s = (byte & 3u) * 8u;
    return (W[i] >> s) | ((W[i + 1u] << 1u) << (31u - s));
}

// A 4-aligned byte offset (IQ4_XS, Q4_K, Q5_K blocks are 8/16-byte multiples, so their fields
// sit at fixed alignments when rows start 4-aligned, as every dispatch here binds them).
fn w_u32_al(byte: u32) -> u32 {
    return W[byte >> 2u];
}

// An even byte offset: the half never straddles two words.
fn w_u16_at(byte: u32) -> u32 {
    return (W[byte >> 2u] >> ((byte & 2u) * 8u)) & 0xffffu;
}

fn w_f16_at(byte: u32) -> f32 {
    return unpack2x16float(w_u16_at(byte)).x;
}

fn w_u8_at(byte: u32) -> u32 {
    return (W[byte >> 2u] >> ((byte & 3u) * 8u)) & 0xffu;
}

fn bytes4(w: u32) -> vec4<u32> {
    return (vec4<u32>(w) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(0xffu);
}

fn nibbles4(w: u32, high: bool) -> vec4<u32> {
    let s = select(0u, 4u, high);
    return (vec4<u32>(w) >> (vec4<u32>(0u, 8u, 16u, 24u) + vec4<u32>(s))) & vec4<u32>(15u);
}

// Sign-extended bytes of w as floats.
fn sbytes4(w: u32) -> vec4<f32> {
    return vec4<f32>(unpack4xI8(w));
}

// kvalues_iq4nl {-127,-104,-83,-65,-49,-35,-22,-10,1,13,25,38,53,69,89,113} as packed int8, four
// per word. Looked up with selects rather than a dynamically indexed constant, which drivers may
// place in per-thread local memory (measured 7% of HBM bandwidth for IQ4_XS on the H200 that way).
const KV0 = 0xBFAD9881u;
const KV1 = 0xF6EADDCFu;
const KV2 = 0x26190D01u;
const KV3 = 0x71594535u;

// A 16-entry int8 codebook packed four per word (entries 4k..4k+3 in word k, lowest byte first),
// looked up for four indices with selects.
fn kv16(n: vec4<u32>, k0: u32, k1: u32, k2: u32, k3: u32) -> vec4<f32> {
    let lo = select(vec4<u32>(k0), vec4<u32>(k1), n >= vec4<u32>(4u));
    let hi = select(vec4<u32>(k2), vec4<u32>(k3), n >= vec4<u32>(12u));
    let w = select(lo, hi, n >= vec4<u32>(8u));
    let shifted = w << (vec4<u32>(24u) - vec4<u32>(8u) * (n & vec4<u32>(3u)));
    return vec4<f32>(bitcast<vec4<i32>>(shifted) >> vec4<u32>(24u));
}

fn kv_iq4nl4(n: vec4<u32>) -> vec4<f32> {
    return kv16(n, KV0, KV1, KV2, KV3);
}

// kvalues_mxfp4 {0,1,2,3,4,6,8,12,0,-1,-2,-3,-4,-6,-8,-12} (E2M1 doubled), packed like KV0..KV3.
fn kv_mxfp4(n: vec4<u32>) -> vec4<f32> {
    return kv16(n, 0x03020100u, 0x0C080604u, 0xFDFEFF00u, 0xF4F8FAFCu);
}

fn dq8_f32(row: u32, g: u32) -> W8 {
    let i = (row >> 2u) + 8u * g;
    return W8(
        vec4<f32>(bitcast<f32>(W[i]), bitcast<f32>(W[i + 1u]), bitcast<f32>(W[i + 2u]), bitcast<f32>(W[i + 3u])),
        vec4<f32>(bitcast<f32>(W[i + 4u]), bitcast<f32>(W[i + 5u]), bitcast<f32>(W[i + 6u]), bitcast<f32>(W[i + 7u])),
    );
}

fn dq8_f16(row: u32, g: u32) -> W8 {
    let i = (row >> 2u) + 4u * g;
    return W8(
        vec4<f32>(unpack2x16float(W[i]), unpack2x16float(W[i + 1u])),
        vec4<f32>(unpack2x16float(W[i + 2u]), unpack2x16float(W[i + 3u])),
    );
}

fn bf16x2(w: u32) -> vec2<f32> {
    return vec2<f32>(bitcast<f32>(w << 16u), bitcast<f32>(w & 0xffff0000u));
}

fn dq8_bf16(row: u32, g: u32) -> W8 {
    let i = (row >> 2u) + 4u * g;
    return W8(vec4<f32>(bf16x2(W[i]), bf16x2(W[i + 1u])), vec4<f32>(bf16x2(W[i + 2u]), bf16x2(W[i + 3u])));
}

// Q8_0: 34-byte blocks {f16 d; i8 qs[32]}.
fn dq8_q8_0(row: u32, g: u32) -> W8 {
    let blk = row + 34u * (g >> 2u);
    let d = w_f16_at(blk);
    let q = blk + 2u + 8u * (g & 3u);
    return W8(d * sbytes4(w_u32_at(q)), d * sbytes4(w_u32_at(q + 4u)));
}

// Q4_0: 18-byte blocks {f16 d; u8 qs[16]}: low nibbles are weights 0..15, high nibbles 16..31.
fn dq8_q4_0(row: u32, g: u32) -> W8 {
    let blk = row + 18u * (g >> 2u);
    let d = w_f16_at(blk);
    let sub = g & 3u;
    let q = blk + 2u + 8u * (sub & 1u);
    let high = sub >= 2u;
    let off = vec4<f32>(8.0);
    return W8(
        d * (vec4<f32>(nibbles4(w_u32_at(q), high)) - off),
        d * (vec4<f32>(nibbles4(w_u32_at(q + 4u), high)) - off),
    );
}

// IQ4_NL: Q4_0's layout with the nibble mapped through kvalues_iq4nl.
fn dq8_iq4_nl(row: u32, g: u32) -> W8 {
    let blk = row + 18u * (g >> 2u);
    let d = w_f16_at(blk);
    let sub = g & 3u;
    let q = blk + 2u + 8u * (sub & 1u);
    let high = sub >= 2u;
    return W8(d * kv_iq4nl4(nibbles4(w_u32_at(q), high)), d * kv_iq4nl4(nibbles4(w_u32_at(q + 4u), high)));
}

// IQ4_XS: 136-byte blocks {f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128]} of 8 sub-blocks of 32.
// The scale of sub-block ib of the block at byte blk: d · (6-bit scale − 32).
fn iq4_xs_scale(blk: u32, ib: u32) -> f32 {
    let d = w_f16_at(blk);
    let sh = w_u16_at(blk + 2u);
    let sl = w_u8_at(blk + 4u + (ib >> 1u));
    let ls = ((sl >> (4u * (ib & 1u))) & 15u) | (((sh >> (2u * ib)) & 3u) << 4u);
    return d * (f32(ls) - 32.0);
}

fn dq8_iq4_xs(row: u32, g: u32) -> W8 {
    let blk = row + 136u * (g >> 5u);
    let j = (g & 31u) * 8u;
    let ib = j >> 5u;
    let t = j & 31u;
    let dl = iq4_xs_scale(blk, ib);
    let q = blk + 8u + 16u * ib + (t & 15u);
    let high = t >= 16u;
    return W8(dl * kv_iq4nl4(nibbles4(w_u32_al(q), high)), dl * kv_iq4nl4(nibbles4(w_u32_al(q + 4u), high)));
}

// 6-bit scale and min of sub-block `is` (0..7) from the 12 packed bytes at `s` (get_scale_min_k4).
fn scale_min_k4(s: u32, is: u32) -> vec2<f32> {
    if is < 4u {
        return vec2<f32>(f32(w_u8_at(s + is) & 63u), f32(w_u8_at(s + is + 4u) & 63u));
    }
    let hi = w_u8_at(s + is + 4u);
    let sc = (hi & 15u) | ((w_u8_at(s + is - 4u) >> 6u) << 4u);
    let m = (hi >> 4u) | ((w_u8_at(s + is) >> 6u) << 4u);
    return vec2<f32>(f32(sc), f32(m));
}

// Q4_K: 144-byte blocks {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}; 4 chunks of 64 weights,
// chunk c = low nibbles (sub-block 2c) then high nibbles (2c+1) of qs[32c..32c+32].
fn dq8_q4_k(row: u32, g: u32) -> W8 {
    let blk = row + 144u * (g >> 5u);
    let j = (g & 31u) * 8u;
    let c = j >> 6u;
    let t = j & 63u;
    let d = w_f16_at(blk);
    let dmin = w_f16_at(blk + 2u);
    let sm = scale_min_k4(blk + 4u, 2u * c + (t >> 5u));
    let scale = d * sm.x;
    let minv = vec4<f32>(dmin * sm.y);
    let q = blk + 16u + 32u * c + (t & 31u);
    let high = t >= 32u;
    return W8(
        scale * vec4<f32>(nibbles4(w_u32_al(q), high)) - minv,
        scale * vec4<f32>(nibbles4(w_u32_al(q + 4u), high)) - minv,
    );
}

// Q5_K: 176-byte blocks {f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}: Q4_K plus a fifth
// bit from qh[l], bit 2c for the low-nibble half of chunk c and bit 2c+1 for the high half.
fn dq8_q5_k(row: u32, g: u32) -> W8 {
    let blk = row + 176u * (g >> 5u);
    let j = (g & 31u) * 8u;
    let c = j >> 6u;
    let t = j & 63u;
    let l = t & 31u;
    let d = w_f16_at(blk);
    let dmin = w_f16_at(blk + 2u);
    let sm = scale_min_k4(blk + 4u, 2u * c + (t >> 5u));
    let scale = d * sm.x;
    let minv = vec4<f32>(dmin * sm.y);
    let bit = 2u * c + (t >> 5u);
    let h0 = ((bytes4(w_u32_al(blk + 16u + l)) >> vec4<u32>(bit)) & vec4<u32>(1u)) << vec4<u32>(4u);
    let h1 = ((bytes4(w_u32_al(blk + 20u + l)) >> vec4<u32>(bit)) & vec4<u32>(1u)) << vec4<u32>(4u);
    let q = blk + 48u + 32u * c + l;
    let high = t >= 32u;
    return W8(
        scale * vec4<f32>(nibbles4(w_u32_al(q), high) | h0) - minv,
        scale * vec4<f32>(nibbles4(w_u32_al(q + 4u), high) | h1) - minv,
    );
}

// Q6_K: 210-byte blocks {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d} (d last): two halves of 128;
// in half h, quarter qd (0..3) of 32 weights takes ql[64h + 32(qd&1) + l] (high nibble if qd ≥ 2)
// and bits 2qd..2qd+1 of qh[32h + l], minus 32, times d * scales[8h + l/16 + 2qd].
fn dq8_q6_k(row: u32, g: u32) -> W8 {
    let blk = row + 210u * (g >> 5u);
    let j = (g & 31u) * 8u;
    let h = j >> 7u;
    let qd = (j & 127u) >> 5u;
    let l = j & 31u;
    let d = w_f16_at(blk + 208u);
    let sc_byte = w_u8_at(blk + 192u + 8u * h + (l >> 4u) + 2u * qd);
    let scale = d * f32(bitcast<i32>(sc_byte << 24u) >> 24u);
    let ql = blk + 64u * h + 32u * (qd & 1u) + l;
    let qh = blk + 128u + 32u * h + l;
    let high = qd >= 2u;
    let sh = vec4<u32>(2u * qd);
    let q0 = nibbles4(w_u32_at(ql), high) | (((bytes4(w_u32_at(qh)) >> sh) & vec4<u32>(3u)) << vec4<u32>(4u));
    let q1 = nibbles4(w_u32_at(ql + 4u), high) | (((bytes4(w_u32_at(qh + 4u)) >> sh) & vec4<u32>(3u)) << vec4<u32>(4u));
    let off = vec4<f32>(32.0);
    return W8(scale * (vec4<f32>(q0) - off), scale * (vec4<f32>(q1) - off));
}

// Q4_1: 20-byte blocks {f16 d; f16 m; u8 qs[16]}: Q4_0's nibble order, y = d·q + m.
fn dq8_q4_1(row: u32, g: u32) -> W8 {
    let blk = row + 20u * (g >> 2u);
    let dm = unpack2x16float(w_u32_al(blk));
    let sub = g & 3u;
    let q = blk + 4u + 8u * (sub & 1u);
    let high = sub >= 2u;
    return W8(
        dm.x * vec4<f32>(nibbles4(w_u32_al(q), high)) + vec4<f32>(dm.y),
        dm.x * vec4<f32>(nibbles4(w_u32_al(q + 4u), high)) + vec4<f32>(dm.y),
    );
}

// The fifth bits (as 16s) of weights 8·sub..8·sub+7 of a Q5_0/Q5_1 block from its u32 qh.
fn q5_high(qh: u32, sub: u32) -> W8u {
    let b = vec4<u32>(qh >> (8u * sub));
    return W8u(
        ((b >> vec4<u32>(0u, 1u, 2u, 3u)) & vec4<u32>(1u)) << vec4<u32>(4u),
        ((b >> vec4<u32>(4u, 5u, 6u, 7u)) & vec4<u32>(1u)) << vec4<u32>(4u),
    );
}

struct W8u {
    a: vec4<u32>,
    b: vec4<u32>,
}

// Q5_0: 22-byte blocks {f16 d; u8 qh[4]; u8 qs[16]}: Q4_0's nibble order plus bit j of qh as
// weight j's fifth bit, y = d·(q − 16).
fn dq8_q5_0(row: u32, g: u32) -> W8 {
    let blk = row + 22u * (g >> 2u);
    let d = w_f16_at(blk);
    let sub = g & 3u;
    let h = q5_high(w_u32_at(blk + 2u), sub);
    let q = blk + 6u + 8u * (sub & 1u);
    let high = sub >= 2u;
    let off = vec4<f32>(16.0);
    return W8(
        d * (vec4<f32>(nibbles4(w_u32_at(q), high) | h.a) - off),
        d * (vec4<f32>(nibbles4(w_u32_at(q + 4u), high) | h.b) - off),
    );
}

// Q5_1: 24-byte blocks {f16 d; f16 m; u8 qh[4]; u8 qs[16]}: Q5_0's values unsigned, y = d·q + m.
fn dq8_q5_1(row: u32, g: u32) -> W8 {
    let blk = row + 24u * (g >> 2u);
    let dm = unpack2x16float(w_u32_al(blk));
    let sub = g & 3u;
    let h = q5_high(w_u32_al(blk + 4u), sub);
    let q = blk + 8u + 8u * (sub & 1u);
    let high = sub >= 2u;
    return W8(
        dm.x * vec4<f32>(nibbles4(w_u32_al(q), high) | h.a) + vec4<f32>(dm.y),
        dm.x * vec4<f32>(nibbles4(w_u32_al(q + 4u), high) | h.b) + vec4<f32>(dm.y),
    );
}

// Bits 2s..2s+1 of each byte of w.
fn crumbs4(w: u32, s: u32) -> vec4<u32> {
    return (bytes4(w) >> vec4<u32>(2u * s)) & vec4<u32>(3u);
}

// Q2_K: 84-byte blocks {u8 scales[16]; u8 qs[64]; f16 d; f16 dmin}. Weight j = 128h + 32s + l is
// bits 2s..2s+1 of qs[32h + l]; its 16-weight group j/16 has scale byte (sc & 15, min sc >> 4):
// y = d·sc·q − dmin·min.
fn dq8_q2_k(row: u32, g: u32) -> W8 {
    let blk = row + 84u * (g >> 5u);
    let j = (g & 31u) * 8u;
    let s = (j >> 5u) & 3u;
    let dm = unpack2x16float(w_u32_al(blk + 80u));
    let sc = w_u8_at(blk + (j >> 4u));
    let dl = dm.x * f32(sc & 15u);
    let ml = vec4<f32>(dm.y * f32(sc >> 4u));
    let q = blk + 16u + 32u * (j >> 7u) + (j & 31u);
    return W8(dl * vec4<f32>(crumbs4(w_u32_al(q), s)) - ml, dl * vec4<f32>(crumbs4(w_u32_al(q + 4u), s)) - ml);
}

// Q3_K: 110-byte blocks {u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d}: Q2_K's 2-bit layout,
// minus 4 where bit j/32 of hmask[j % 32] is clear; sixteen 6-bit scales (low nibbles in bytes
// 0..8, two high bits each in bytes 8..12), offset −32: y = d·(sc − 32)·q.
fn dq8_q3_k(row: u32, g: u32) -> W8 {
    let blk = row + 110u * (g >> 5u);
    let j = (g & 31u) * 8u;
    let s = (j >> 5u) & 3u;
    let l = j & 31u;
    let k = j >> 4u;
    let low = (w_u8_at(blk + 96u + (k & 7u)) >> (4u * (k >> 3u))) & 15u;
    let high = (w_u8_at(blk + 104u + (k & 3u)) >> (2u * (k >> 2u))) & 3u;
    let dl = w_f16_at(blk + 108u) * (f32(low | (high << 4u)) - 32.0);
    let q = blk + 32u + 32u * (j >> 7u) + l;
    let hb = vec4<u32>(j >> 5u);
    let m0 = (bytes4(w_u32_at(blk + l)) >> hb) & vec4<u32>(1u);
    let m1 = (bytes4(w_u32_at(blk + l + 4u)) >> hb) & vec4<u32>(1u);
    let four = vec4<f32>(4.0);
    return W8(
        dl * (vec4<f32>(crumbs4(w_u32_at(q), s)) - four * vec4<f32>(vec4<u32>(1u) - m0)),
        dl * (vec4<f32>(crumbs4(w_u32_at(q + 4u), s)) - four * vec4<f32>(vec4<u32>(1u) - m1)),
    );
}

// Sizes in words of the IQ grids (rust/gguf/grids.rs: 16-bit entries, two per word, entry 2k in
// the low half). Gpu::upload_weight_windowed appends the type's grid to every weight window, so it
// fills the last `words` words of W: a 9 KiB table indexed by data, which as a WGSL constant or
// private array costs naga's per-access copies and lavapipe minutes of compilation.
const IQ2XXS_WORDS = 128u;
const IQ2XS_WORDS = 256u;
const IQ2S_WORDS = 512u;
const IQ3XXS_WORDS = 128u;
const IQ3S_WORDS = 256u;
const IQ1S_WORDS = 1024u;

// Entry i of the grid of `words` words at the end of W.
fn iq_grid(words: u32, i: u32) -> u32 {
    return (W[arrayLength(&W) - words + (i >> 1u)] >> ((i & 1u) * 16u)) & 0xffffu;
}

// The 2-bit codes of an 8-element grid entry as vectors (element j at bits 2j).
fn codes8(e: u32) -> W8u {
    let v = vec4<u32>(e);
    return W8u((v >> vec4<u32>(0u, 2u, 4u, 6u)) & vec4<u32>(3u), (v >> vec4<u32>(8u, 10u, 12u, 14u)) & vec4<u32>(3u));
}

// IQ2 grid levels {8, 25, 43} of codes 0, 1, 2: 8 + 17c + c/2.
fn iq2_level(c: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(vec4<u32>(8u) + vec4<u32>(17u) * c + (c >> vec4<u32>(1u)));
}

fn iq2_entry(e: u32) -> W8 {
    let c = codes8(e);
    return W8(iq2_level(c.a), iq2_level(c.b));
}

// The 4-bit codes of a 4-element grid entry (element j at bits 4j).
fn codes4(e: u32) -> vec4<u32> {
    return (vec4<u32>(e) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u);
}

// IQ3_XXS grid levels {4, 12, …, 52, 62}: 4 + 8c, except 62 for c = 7.
fn iq3xxs_entry(e: u32) -> vec4<f32> {
    let c = codes4(e);
    return vec4<f32>(select(vec4<u32>(4u) + vec4<u32>(8u) * c, vec4<u32>(62u), c == vec4<u32>(7u)));
}

// IQ3_S grid levels 2c + 1.
fn iq3s_entry(e: u32) -> vec4<f32> {
    return vec4<f32>(vec4<u32>(2u) * codes4(e) + vec4<u32>(1u));
}

// ksigns_iq2xs: 7 stored sign bits, the eighth makes the count of minus signs even.
fn ksign(i: u32) -> u32 {
    let s = i & 127u;
    return s | ((countOneBits(s) & 1u) << 7u);
}

// ±1 for bits 0..3 of s (set: −1).
fn signs4(s: u32) -> vec4<f32> {
    let bit = (vec4<u32>(s) >> vec4<u32>(0u, 1u, 2u, 3u)) & vec4<u32>(1u);
    return select(vec4<f32>(1.0), vec4<f32>(-1.0), bit == vec4<u32>(1u));
}

// db · v · ±1 with sign byte s (bit j: weight j negative).
fn signed8(db: f32, v: W8, s: u32) -> W8 {
    return W8(db * v.a * signs4(s), db * v.b * signs4(s >> 4u));
}

// IQ2_XS / IQ2_S scale of 8-weight group gg (0..31) from the nibbles of the 8 bytes at `sc`:
// d·(0.5 + s)·0.25.
fn iq2_db(d: f32, sc: u32, gg: u32) -> f32 {
    let s = (w_u8_at(sc + (gg >> 2u)) >> (4u * ((gg >> 1u) & 1u))) & 15u;
    return d * (0.5 + f32(s)) * 0.25;
}

// IQ2_XXS: 66-byte blocks {f16 d; u16 qs[32]}. Each 32 weights are two u32: four grid indices
// (bytes of the first) and four 7-bit sign indices plus a 4-bit scale ls (bits 28..31) in the
// second; db = d·(0.5 + ls)·0.25.
fn dq8_iq2_xxs(row: u32, g: u32) -> W8 {
    let blk = row + 66u * (g >> 5u);
    let gg = g & 31u;
    let ib = gg >> 2u;
    let l = gg & 3u;
    let idx = w_u8_at(blk + 2u + 8u * ib + l);
    let aux = w_u32_at(blk + 6u + 8u * ib);
    let db = w_f16_at(blk) * (0.5 + f32(aux >> 28u)) * 0.25;
    return signed8(db, iq2_entry(iq_grid(IQ2XXS_WORDS, idx)), ksign(aux >> (7u * l)));
}

// IQ2_XS: 74-byte blocks {f16 d; u16 qs[32]; u8 scales[8]}: each u16 is one group of 8, grid
// index in its low 9 bits and sign index in its high 7.
fn dq8_iq2_xs(row: u32, g: u32) -> W8 {
    let blk = row + 74u * (g >> 5u);
    let gg = g & 31u;
    let q = w_u16_at(blk + 2u + 2u * gg);
    let idx = q & 511u;
    let db = iq2_db(w_f16_at(blk), blk + 66u, gg);
    return signed8(db, iq2_entry(iq_grid(IQ2XS_WORDS, idx)), ksign(q >> 9u));
}

// IQ2_S: 82-byte blocks {f16 d; u8 qs[32]; u8 signs[32]; u8 qh[8]; u8 scales[8]}: group gg's grid
// index is qs[gg] plus bits 2(gg % 4)..+1 of qh[gg / 4] as bits 8..9, its sign byte signs[gg].
fn dq8_iq2_s(row: u32, g: u32) -> W8 {
    let blk = row + 82u * (g >> 5u);
    let gg = g & 31u;
    let hi = (w_u8_at(blk + 66u + (gg >> 2u)) >> (2u * (gg & 3u))) & 3u;
    let idx = w_u8_at(blk + 2u + gg) | (hi << 8u);
    let db = iq2_db(w_f16_at(blk), blk + 74u, gg);
    return signed8(db, iq2_entry(iq_grid(IQ2S_WORDS, idx)), w_u8_at(blk + 34u + gg));
}

// IQ3_XXS: 98-byte blocks {f16 d; u8 qs[64]; u32 scales_and_signs[8]}: group gg takes the 4-weight
// grid entries qs[2gg], qs[2gg + 1]; each 32 weights share a u32 of four 7-bit sign indices and a
// 4-bit scale ls: db = d·(0.5 + ls)·0.5.
fn dq8_iq3_xxs(row: u32, g: u32) -> W8 {
    let blk = row + 98u * (g >> 5u);
    let gg = g & 31u;
    let aux = w_u32_at(blk + 66u + 4u * (gg >> 2u));
    let db = w_f16_at(blk) * (0.5 + f32(aux >> 28u)) * 0.5;
    let i0 = w_u8_at(blk + 2u + 2u * gg);
    let i1 = w_u8_at(blk + 3u + 2u * gg);
    let v = W8(iq3xxs_entry(iq_grid(IQ3XXS_WORDS, i0)), iq3xxs_entry(iq_grid(IQ3XXS_WORDS, i1)));
    return signed8(db, v, ksign(aux >> (7u * (gg & 3u))));
}

// IQ3_S: 110-byte blocks {f16 d; u8 qs[64]; u8 qh[8]; u8 signs[32]; u8 scales[4]}: grid entry k
// (4 weights) has index qs[k] plus bit k % 8 of qh[k / 8] as bit 8; group gg's sign byte is
// signs[gg]; each 32 weights have a 4-bit scale s: db = d·(1 + 2s).
fn dq8_iq3_s(row: u32, g: u32) -> W8 {
    let blk = row + 110u * (g >> 5u);
    let gg = g & 31u;
    let ib = gg >> 2u;
    let s = (w_u8_at(blk + 106u + (ib >> 1u)) >> (4u * (ib & 1u))) & 15u;
    let db = w_f16_at(blk) * f32(1u + 2u * s);
    let qh = w_u8_at(blk + 66u + ib) >> (2u * (gg & 3u));
    let i0 = w_u8_at(blk + 2u + 2u * gg) | ((qh & 1u) << 8u);
    let i1 = w_u8_at(blk + 3u + 2u * gg) | (((qh >> 1u) & 1u) << 8u);
    let v = W8(iq3s_entry(iq_grid(IQ3S_WORDS, i0)), iq3s_entry(iq_grid(IQ3S_WORDS, i1)));
    return signed8(db, v, w_u8_at(blk + 74u + gg));
}

// dl · (grid + delta) for IQ1 grid entry idx (levels −1, 0, 1 of codes 0, 1, 2) and a delta of
// ±1/8 (ggml IQ1S_DELTA), negative when `neg`.
fn iq1_group(dl: f32, idx: u32, neg: bool) -> W8 {
    let c = codes8(iq_grid(IQ1S_WORDS, idx));
    let off = vec4<f32>(select(0.125, -0.125, neg) - 1.0);
    return W8(dl * (vec4<f32>(c.a) + off), dl * (vec4<f32>(c.b) + off));
}

// IQ1_S: 50-byte blocks {f16 d; u8 qs[32]; u16 qh[8]}: each 32 weights have a u16 qh whose bits
// 3l..3l+2 are bits 8..10 of group l's grid index (low byte qs[gg]), bits 12..14 a scale s
// (dl = d·(2s + 1)) and bit 15 the sign of the delta.
fn dq8_iq1_s(row: u32, g: u32) -> W8 {
    let blk = row + 50u * (g >> 5u);
    let gg = g & 31u;
    let qh = w_u16_at(blk + 34u + 2u * (gg >> 2u));
    let dl = w_f16_at(blk) * f32(2u * ((qh >> 12u) & 7u) + 1u);
    let idx = w_u8_at(blk + 2u + gg) | (((qh >> (3u * (gg & 3u))) & 7u) << 8u);
    return iq1_group(dl, idx, (qh & 0x8000u) != 0u);
}

// IQ1_M: 56-byte blocks {u8 qs[32]; u8 qh[16]; u16 scales[4]}: the f16 d is the top nibbles of the
// four scale words (first word lowest); nibble gg % 2 of qh[gg / 2] gives index bits 8..10 and
// (bit 3) the delta's sign; 3-bit scale k = gg / 2 is bits 3(k % 4).. of scales[k / 4].
fn dq8_iq1_m(row: u32, g: u32) -> W8 {
    let blk = row + 56u * (g >> 5u);
    let gg = g & 31u;
    let s01 = w_u32_al(blk + 48u);
    let s23 = w_u32_al(blk + 52u);
    let d_bits = ((s01 >> 12u) & 0xfu) | ((s01 >> 24u) & 0xf0u) | ((s23 >> 4u) & 0xf00u) | ((s23 >> 16u) & 0xf000u);
    let k = gg >> 1u;
    let s = (w_u16_at(blk + 48u + 2u * (k >> 2u)) >> (3u * (k & 3u))) & 7u;
    let dl = unpack2x16float(d_bits).x * f32(2u * s + 1u);
    let nib = (w_u8_at(blk + 32u + k) >> (4u * (gg & 1u))) & 15u;
    let idx = w_u8_at(blk + gg) | ((nib & 7u) << 8u);
    return iq1_group(dl, idx, (nib & 8u) != 0u);
}

// MXFP4: 17-byte blocks {u8 e (E8M0); u8 qs[16]}: Q4_0's nibble order, y = d·kvalues_mxfp4[q]
// with d half the E8M0 scale, 2^(e − 128) (ggml GGML_E8M0_TO_FP32_HALF; subnormal for e < 2).
fn dq8_mxfp4(row: u32, g: u32) -> W8 {
    let blk = row + 17u * (g >> 2u);
    let e = w_u8_at(blk);
    let d = bitcast<f32>(select((e - 1u) << 23u, 0x00200000u << e, e < 2u));
    let sub = g & 3u;
    let q = blk + 1u + 8u * (sub & 1u);
    let high = sub >= 2u;
    return W8(d * kv_mxfp4(nibbles4(w_u32_at(q), high)), d * kv_mxfp4(nibbles4(w_u32_at(q + 4u), high)));
}
