//! CPU dequantisation of every ggml type qk reads: the ground truth for the GPU kernels.
//! Block layouts and formulas: ggml-common.h block structs and ggml-quants.c `dequantize_row_*`
//! (summarised in docs/numerics.md "GGUF block formats"). Products are formed in the same order as ggml
//! (`d * scale` first, then `* q`), so results match ggml bit for bit.

use half::f16;

use super::types::{GgmlType, KVALUES_IQ4NL};
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
        GgmlType::IQ4NL => blocks.for_each(|(b, y)| block_iq4_nl(b, y)),
        GgmlType::IQ4XS => blocks.for_each(|(b, y)| block_iq4_xs(b, y)),
        GgmlType::Q4K => blocks.for_each(|(b, y)| block_q4_k(b, y)),
        GgmlType::Q5K => blocks.for_each(|(b, y)| block_q5_k(b, y)),
        GgmlType::Q6K => blocks.for_each(|(b, y)| block_q6_k(b, y)),
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
