// Dequantisation of ggml weight blocks read from `W: array<u32>` (declared by the including kernel:
// WGSL has no u8 storage). `dq8_<type>(row, g)` returns weights 8g..8g+7 of the row that starts at
// byte `row` of W. Block layouts and formulas: docs/numerics.md "GGUF block formats" (ggml-common.h). Rows may
// start at any even byte (Q6_K blocks are 210 bytes, Q8_0 34, IQ4_NL 18), so reads go through
// w_u32_at, which funnels two words when the offset is not 4-aligned.

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

fn kv_iq4nl4(n: vec4<u32>) -> vec4<f32> {
    let lo = select(vec4<u32>(KV0), vec4<u32>(KV1), n >= vec4<u32>(4u));
    let hi = select(vec4<u32>(KV2), vec4<u32>(KV3), n >= vec4<u32>(12u));
    let w = select(lo, hi, n >= vec4<u32>(8u));
    let shifted = w << (vec4<u32>(24u) - vec4<u32>(8u) * (n & vec4<u32>(3u)));
    return vec4<f32>(bitcast<vec4<i32>>(shifted) >> vec4<u32>(24u));
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
fn dq8_iq4_xs(row: u32, g: u32) -> W8 {
    let blk = row + 136u * (g >> 5u);
    let j = (g & 31u) * 8u;
    let ib = j >> 5u;
    let t = j & 31u;
    let d = w_f16_at(blk);
    let sh = w_u16_at(blk + 2u);
    let sl = w_u8_at(blk + 4u + (ib >> 1u));
    let ls = ((sl >> (4u * (ib & 1u))) & 15u) | (((sh >> (2u * ib)) & 3u) << 4u);
    let dl = d * (f32(ls) - 32.0);
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
