//! CPU dequantisation of every ggml type qk reads: the ground truth for the GPU kernels.
//! Block layouts and formulas: ggml-common.h block structs and ggml-quants.c `dequantize_row_*`
//! (summarised in docs/numerics.md "GGUF block formats"). Products are formed in the same order as ggml
//! and gguf-py (`d * scale` first, then `* q`), so results match both bit for bit
//! (tests/test_dequant.py).

use half::f16;

use super::grids::{
    IQ1_LEVELS, IQ1S_GRID, IQ2_LEVELS, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3S_LEVELS,
    IQ3XXS_GRID, IQ3XXS_LEVELS,
};
use super::types::{GgmlType, KVALUES_IQ4NL, KVALUES_MXFP4};
use crate::error::{QkError, Result};

/// Dequantise `n` weights of type `ty` stored in `data` (exactly `ty.bytes_for(n)` bytes) to f32.
pub fn dequantize(ty: GgmlType, data: &[u8], n: usize) -> Result<Vec<f32>> {
    let expected = ty.bytes_for(n as u64).ok_or_else(|| {
        QkError::Engine(format!(
            "dequantize {ty}: {n} weights are not a whole number of {}-weight blocks",
            ty.block_len()
        ))
    })?;
    if data.len() as u64 != expected {
        return Err(QkError::Engine(format!(
            "dequantize {ty}: {n} weights take {expected} bytes, got {}",
            data.len()
        )));
    }
    let mut out = vec![0f32; n];
    let blocks = data
        .chunks_exact(ty.block_bytes())
        .zip(out.chunks_exact_mut(ty.block_len()));
    match ty {
        GgmlType::F32 => blocks.for_each(|(b, y)| y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        GgmlType::F16 => blocks.for_each(|(b, y)| y[0] = half_at(b, 0)),
        // bf16 is the top half of an f32.
        GgmlType::BF16 => blocks.for_each(|(b, y)| y[0] = f32::from_bits(u32::from(u16_at(b, 0)) << 16)),
        GgmlType::Q8_0 => blocks.for_each(|(b, y)| block_q8_0(b, y)),
        GgmlType::Q4_0 => blocks.for_each(|(b, y)| block_q4_0(b, y)),
        GgmlType::Q4_1 => blocks.for_each(|(b, y)| block_q4_1(b, y)),
        GgmlType::Q5_0 => blocks.for_each(|(b, y)| block_q5_0(b, y)),
        GgmlType::Q5_1 => blocks.for_each(|(b, y)| block_q5_1(b, y)),
        GgmlType::IQ4NL => blocks.for_each(|(b, y)| block_iq4_nl(b, y)),
        GgmlType::IQ4XS => blocks.for_each(|(b, y)| block_iq4_xs(b, y)),
        GgmlType::Q2K => blocks.for_each(|(b, y)| block_q2_k(b, y)),
        GgmlType::Q3K => blocks.for_each(|(b, y)| block_q3_k(b, y)),
        GgmlType::Q4K => blocks.for_each(|(b, y)| block_q4_k(b, y)),
        GgmlType::Q5K => blocks.for_each(|(b, y)| block_q5_k(b, y)),
        GgmlType::Q6K => blocks.for_each(|(b, y)| block_q6_k(b, y)),
        GgmlType::IQ1S => blocks.for_each(|(b, y)| block_iq1_s(b, y)),
        GgmlType::IQ1M => blocks.for_each(|(b, y)| block_iq1_m(b, y)),
        GgmlType::IQ2XXS => blocks.for_each(|(b, y)| block_iq2_xxs(b, y)),
        GgmlType::IQ2XS => blocks.for_each(|(b, y)| block_iq2_xs(b, y)),
        GgmlType::IQ2S => blocks.for_each(|(b, y)| block_iq2_s(b, y)),
        GgmlType::IQ3XXS => blocks.for_each(|(b, y)| block_iq3_xxs(b, y)),
        GgmlType::IQ3S => blocks.for_each(|(b, y)| block_iq3_s(b, y)),
        GgmlType::MXFP4 => blocks.for_each(|(b, y)| block_mxfp4(b, y)),
    }
    Ok(out)
}

fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

fn half_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16_at(b, i)).to_f32()
}

/// block_q8_0: half d; i8 qs[32].
fn block_q8_0(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    for (yj, &q) in y.iter_mut().zip(&b[2..34]) {
        *yj = d * f32::from(q as i8);
    }
}

/// block_q4_0: half d; u8 qs[16]; low nibbles are weights 0..16, high nibbles 16..32, offset −8.
fn block_q4_0(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    for (j, &q) in b[2..18].iter().enumerate() {
        y[j] = d * f32::from((q & 15) as i8 - 8);
        y[j + 16] = d * f32::from((q >> 4) as i8 - 8);
    }
}

/// block_iq4_nl: as Q4_0 but each nibble indexes the non-linear codebook.
fn block_iq4_nl(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    for (j, &q) in b[2..18].iter().enumerate() {
        y[j] = d * f32::from(KVALUES_IQ4NL[usize::from(q & 15)]);
        y[j + 16] = d * f32::from(KVALUES_IQ4NL[usize::from(q >> 4)]);
    }
}

/// block_iq4_xs: half d; u16 scales_h; u8 scales_l[4]; u8 qs[128]. Eight sub-blocks of 32 with
/// 6-bit scales (low 4 bits in scales_l nibbles, high 2 bits in scales_h), offset −32.
fn block_iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let scales_h = u16_at(b, 2);
    let scales_l = &b[4..8];
    let qs = &b[8..136];
    for ib in 0..8 {
        let low = (scales_l[ib / 2] >> (4 * (ib % 2))) & 15;
        let high = ((scales_h >> (2 * ib)) & 3) as u8;
        let dl = d * f32::from((low | (high << 4)) as i8 - 32);
        let q = &qs[16 * ib..16 * ib + 16];
        let out = &mut y[32 * ib..32 * ib + 32];
        for j in 0..16 {
            out[j] = dl * f32::from(KVALUES_IQ4NL[usize::from(q[j] & 15)]);
            out[j + 16] = dl * f32::from(KVALUES_IQ4NL[usize::from(q[j] >> 4)]);
        }
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) from the 12 packed bytes of Q4_K/Q5_K
/// (ggml-quants.c `get_scale_min_k4`).
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// block_q4_k: half d; half dmin; u8 scales[12]; u8 qs[128]. Four chunks of 64 weights: chunk c
/// takes sub-block 2c from the low nibbles of qs[32c..32c+32] and 2c+1 from the high nibbles.
fn block_q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    for c in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * c, scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, min1) = (d * f32::from(sc1), dmin * f32::from(m1));
        let (d2, min2) = (d * f32::from(sc2), dmin * f32::from(m2));
        let q = &qs[32 * c..32 * c + 32];
        let out = &mut y[64 * c..64 * c + 64];
        for l in 0..32 {
            out[l] = d1 * f32::from(q[l] & 15) - min1;
            out[l + 32] = d2 * f32::from(q[l] >> 4) - min2;
        }
    }
}

/// block_q5_k: half d; half dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]. Q4_K plus a fifth bit per
/// weight: in chunk c, bit 2c of qh[l] for the low nibble, bit 2c+1 for the high nibble.
fn block_q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for c in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * c, scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, min1) = (d * f32::from(sc1), dmin * f32::from(m1));
        let (d2, min2) = (d * f32::from(sc2), dmin * f32::from(m2));
        let (bit1, bit2) = (1u8 << (2 * c), 2u8 << (2 * c));
        let q = &qs[32 * c..32 * c + 32];
        let out = &mut y[64 * c..64 * c + 64];
        for l in 0..32 {
            let hi1 = if qh[l] & bit1 != 0 { 16 } else { 0 };
            let hi2 = if qh[l] & bit2 != 0 { 16 } else { 0 };
            out[l] = d1 * f32::from((q[l] & 15) + hi1) - min1;
            out[l + 32] = d2 * f32::from((q[l] >> 4) + hi2) - min2;
        }
    }
}

/// block_q6_k: u8 ql[128]; u8 qh[64]; i8 scales[16]; half d (last). Two halves of 128 weights;
/// 6-bit values (4 low bits from ql, 2 high bits from qh), offset −32, one scale per 16 weights.
fn block_q6_k(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 208);
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let sc = &b[192 + 8 * half..192 + 8 * half + 8];
        let out = &mut y[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 15) | ((qh[l] & 3) << 4)) as i8 - 32;
            let q2 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
            out[l] = d * f32::from(sc[is] as i8) * f32::from(q1);
            out[l + 32] = d * f32::from(sc[is + 2] as i8) * f32::from(q2);
            out[l + 64] = d * f32::from(sc[is + 4] as i8) * f32::from(q3);
            out[l + 96] = d * f32::from(sc[is + 6] as i8) * f32::from(q4);
        }
    }
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

/// block_q4_1: half d; half m; u8 qs[16]: Q4_0's nibble order, y = d·q + m.
fn block_q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    for (j, &q) in b[4..20].iter().enumerate() {
        y[j] = d * f32::from(q & 15) + m;
        y[j + 16] = d * f32::from(q >> 4) + m;
    }
}

/// The 5-bit values of a Q5_0/Q5_1 block: Q4_0's nibble order, bit j of the u32 `qh` is weight j's
/// fifth bit.
fn q5_values(qh: u32, qs: &[u8]) -> impl Iterator<Item = (usize, u8)> + '_ {
    qs.iter().enumerate().flat_map(move |(j, &q)| {
        let hi = |k: usize| (((qh >> k) & 1) << 4) as u8;
        [(j, (q & 15) | hi(j)), (j + 16, (q >> 4) | hi(j + 16))]
    })
}

/// block_q5_0: half d; u8 qh[4]; u8 qs[16]; y = d·(q − 16).
fn block_q5_0(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    for (j, q) in q5_values(u32_at(b, 2), &b[6..22]) {
        y[j] = d * f32::from(q as i8 - 16);
    }
}

/// block_q5_1: half d; half m; u8 qh[4]; u8 qs[16]; y = d·q + m.
fn block_q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    for (j, q) in q5_values(u32_at(b, 4), &b[8..24]) {
        y[j] = d * f32::from(q) + m;
    }
}

/// block_q2_k: u8 scales[16]; u8 qs[64]; half d; half dmin. Weight 128h + 32s + l (h < 2, s < 4,
/// l < 32) is bits 2s..2s+1 of qs[32h + l]; its 16-weight group k = 8h + 2s + l/16 has scale
/// scales[k] & 15 and min scales[k] >> 4: y = d·sc·q − dmin·m.
fn block_q2_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (half_at(b, 80), half_at(b, 82));
    let (scales, qs) = (&b[0..16], &b[16..80]);
    for (i, yi) in y.iter_mut().enumerate() {
        let (h, s, l) = (i / 128, (i / 32) % 4, i % 32);
        let sc = scales[i / 16];
        let q = (qs[32 * h + l] >> (2 * s)) & 3;
        *yi = d * f32::from(sc & 15) * f32::from(q) - dmin * f32::from(sc >> 4);
    }
}

/// block_q3_k: u8 hmask[32]; u8 qs[64]; u8 scales[12]; half d. Q2_K's 2-bit layout; bit i / 32
/// of hmask[i % 32] clear subtracts 4; sixteen 6-bit scales (low nibbles in bytes 0..8, two high
/// bits each in bytes 8..12), offset −32: y = d·(sc − 32)·q.
fn block_q3_k(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 108);
    let (hmask, qs, sc) = (&b[0..32], &b[32..96], &b[96..108]);
    let scale = |k: usize| {
        let low = if k < 8 { sc[k] & 15 } else { sc[k - 8] >> 4 };
        let high = (sc[8 + k % 4] >> (2 * (k / 4))) & 3;
        d * f32::from((low | (high << 4)) as i8 - 32)
    };
    for (i, yi) in y.iter_mut().enumerate() {
        let (h, s, l) = (i / 128, (i / 32) % 4, i % 32);
        let low = ((qs[32 * h + l] >> (2 * s)) & 3) as i8;
        let q = if hmask[l] >> (i / 32) & 1 == 1 {
            low
        } else {
            low - 4
        };
        *yi = scale(i / 16) * f32::from(q);
    }
}

/// Entry `i` of a packed grid (grids.rs): `n` codes of `bits` bits mapped through `levels`.
fn grid_entry<'a, T: Copy + Into<f32>>(
    grid: &'a [u16],
    i: usize,
    n: usize,
    bits: u32,
    levels: &'a [T],
) -> impl Iterator<Item = f32> + 'a {
    let e = grid[i];
    (0..n).map(move |j| levels[usize::from((e >> (bits * j as u32)) & ((1 << bits) - 1))].into())
}

/// ksigns_iq2xs: 7 stored sign bits, the eighth makes the count of minus signs even.
fn ksign(i: u32) -> u32 {
    let i = i & 127;
    i | ((i.count_ones() & 1) << 7)
}

/// Eight weights `db · g · ±1` of an IQ2/IQ3 grid entry with sign byte `signs` (bit j set: weight
/// j negative), into `y`.
fn signed_group(y: &mut [f32], db: f32, grid: impl Iterator<Item = f32>, signs: u32) {
    for (j, (yj, g)) in y.iter_mut().zip(grid).enumerate() {
        *yj = db * g * if (signs >> j) & 1 == 1 { -1.0 } else { 1.0 };
    }
}

fn iq2_grid(grid: &[u16], i: usize) -> impl Iterator<Item = f32> + '_ {
    grid_entry(grid, i, 8, 2, &IQ2_LEVELS)
}

/// block_iq2_xxs: half d; u16 qs[32]. Each 32 weights are two u32: four grid indices (bytes of
/// the first), four 7-bit sign indices and a 4-bit scale ls (bits 28..32 of the second);
/// db = d·(0.5 + ls)·0.25.
fn block_iq2_xxs(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    for (ib, out) in y.chunks_exact_mut(32).enumerate() {
        let (grid, aux) = (u32_at(b, 2 + 8 * ib), u32_at(b, 6 + 8 * ib));
        let db = d * (0.5 + (aux >> 28) as f32) * 0.25;
        for (l, group) in out.chunks_exact_mut(8).enumerate() {
            let idx = ((grid >> (8 * l)) & 255) as usize;
            signed_group(group, db, iq2_grid(&IQ2XXS_GRID, idx), ksign(aux >> (7 * l)));
        }
    }
}

/// The IQ2_XS / IQ2_S scale of 16-weight group k from the nibbles of `scales`.
fn iq2_db(d: f32, scales: &[u8], k: usize) -> f32 {
    d * (0.5 + f32::from((scales[k / 2] >> (4 * (k % 2))) & 15)) * 0.25
}

/// block_iq2_xs: half d; u16 qs[32]; u8 scales[8]. Each u16 is one group of 8: grid index in its
/// low 9 bits, sign index in its high 7.
fn block_iq2_xs(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let scales = &b[66..74];
    for (g, group) in y.chunks_exact_mut(8).enumerate() {
        let q = u32::from(u16_at(b, 2 + 2 * g));
        let grid = iq2_grid(&IQ2XS_GRID, (q & 511) as usize);
        signed_group(group, iq2_db(d, scales, g / 2), grid, ksign(q >> 9));
    }
}

/// block_iq2_s: half d; u8 qs[32]; u8 signs[32]; u8 qh[8]; u8 scales[8]. Group g's grid index is
/// qs[g] plus bits 2(g%4)..+1 of qh[g/4] as bits 8..9; its sign byte is signs[g].
fn block_iq2_s(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let (qs, signs, qh, scales) = (&b[2..34], &b[34..66], &b[66..74], &b[74..82]);
    for (g, group) in y.chunks_exact_mut(8).enumerate() {
        let idx = usize::from(qs[g]) | (usize::from((qh[g / 4] >> (2 * (g % 4))) & 3) << 8);
        let grid = iq2_grid(&IQ2S_GRID, idx);
        signed_group(group, iq2_db(d, scales, g / 2), grid, u32::from(signs[g]));
    }
}

/// block_iq3_xxs: half d; u8 qs[64]; u32 scales_and_signs[8]. Groups of 8 take two 4-weight grid
/// entries qs[2g], qs[2g+1]; each 32 weights share a u32 of four 7-bit sign indices and a 4-bit
/// scale ls: db = d·(0.5 + ls)·0.5.
fn block_iq3_xxs(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let qs = &b[2..66];
    for (g, group) in y.chunks_exact_mut(8).enumerate() {
        let aux = u32_at(b, 66 + 4 * (g / 4));
        let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
        let entry = |k: usize| grid_entry(&IQ3XXS_GRID, usize::from(qs[k]), 4, 4, &IQ3XXS_LEVELS);
        let grid = entry(2 * g).chain(entry(2 * g + 1));
        signed_group(group, db, grid, ksign(aux >> (7 * (g % 4))));
    }
}

/// block_iq3_s: half d; u8 qs[64]; u8 qh[8]; u8 signs[32]; u8 scales[4]. Grid entry k (4 weights)
/// has index qs[k] plus bit k%8 of qh[k/8] as bit 8; group g's sign byte is signs[g]; each 32
/// weights have a 4-bit scale s: db = d·(1 + 2s).
fn block_iq3_s(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let (qs, qh, signs, scales) = (&b[2..66], &b[66..74], &b[74..106], &b[106..110]);
    for (g, group) in y.chunks_exact_mut(8).enumerate() {
        let ib = g / 4;
        let db = d * f32::from(1 + 2 * ((scales[ib / 2] >> (4 * (ib % 2))) & 15));
        let entry = |k: usize| {
            let idx = usize::from(qs[k]) | (usize::from((qh[k / 8] >> (k % 8)) & 1) << 8);
            grid_entry(&IQ3S_GRID, idx, 4, 4, &IQ3S_LEVELS)
        };
        let grid = entry(2 * g).chain(entry(2 * g + 1));
        signed_group(group, db, grid, u32::from(signs[g]));
    }
}

/// IQ1_S / IQ1_M grid offset: the grid's {−1, 0, 1} shifted by ±1/8 (ggml IQ1S_DELTA).
const IQ1_DELTA: f32 = 0.125;

/// Eight IQ1 weights `dl · (g + delta)` of grid entry `idx`.
fn iq1_group(y: &mut [f32], dl: f32, idx: usize, negative_delta: bool) {
    let delta = if negative_delta { -IQ1_DELTA } else { IQ1_DELTA };
    for (yj, g) in y.iter_mut().zip(grid_entry(&IQ1S_GRID, idx, 8, 2, &IQ1_LEVELS)) {
        *yj = dl * (g + delta);
    }
}

/// block_iq1_s: half d; u8 qs[32]; u16 qh[8]. Each 32 weights have a u16 qh: bits 3l..3l+2 are
/// bits 8..10 of group l's grid index (low byte qs[g]), bits 12..14 a 3-bit scale s
/// (dl = d·(2s + 1)), bit 15 the sign of the delta.
fn block_iq1_s(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    for (g, group) in y.chunks_exact_mut(8).enumerate() {
        let qh = u16_at(b, 34 + 2 * (g / 4));
        let dl = d * f32::from(2 * ((qh >> 12) & 7) + 1);
        let idx = usize::from(b[2 + g]) | (usize::from((qh >> (3 * (g % 4))) & 7) << 8);
        iq1_group(group, dl, idx, qh & 0x8000 != 0);
    }
}

/// block_iq1_m: u8 qs[32]; u8 qh[16]; u16 scales[4]. The f16 d is spread over the top nibbles
/// of the four scale words (first word lowest); group g's nibble g%2 of qh[g/2] gives index bits
/// 8..10 and (bit 3) the delta's sign; 3-bit scale k = g/2 is bits 3(k%4).. of scales[k/4].
fn block_iq1_m(b: &[u8], y: &mut [f32]) {
    let sc: [u16; 4] = std::array::from_fn(|k| u16_at(b, 48 + 2 * k));
    let d_bits = (sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000);
    let d = f16::from_bits(d_bits).to_f32();
    for (g, group) in y.chunks_exact_mut(8).enumerate() {
        let k = g / 2;
        let dl = d * f32::from(2 * ((sc[k / 4] >> (3 * (k % 4))) & 7) + 1);
        let nib = (b[32 + g / 2] >> (4 * (g % 2))) & 15;
        let idx = usize::from(b[g]) | (usize::from(nib & 7) << 8);
        iq1_group(group, dl, idx, nib & 8 != 0);
    }
}

/// Half of an E8M0 scale 2^(e − 127) as f32 (ggml `GGML_E8M0_TO_FP32_HALF`): subnormal for e < 2.
fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        u32::from(e - 1) << 23
    };
    f32::from_bits(bits)
}

/// block_mxfp4: u8 e (E8M0); u8 qs[16]: Q4_0's nibble order, y = e8m0_half(e) · kvalues_mxfp4[q].
fn block_mxfp4(b: &[u8], y: &mut [f32]) {
    let d = e8m0_half(b[0]);
    for (j, &q) in b[1..17].iter().enumerate() {
        y[j] = d * f32::from(KVALUES_MXFP4[usize::from(q & 15)]);
        y[j + 16] = d * f32::from(KVALUES_MXFP4[usize::from(q >> 4)]);
    }
}
