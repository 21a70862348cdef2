//! Hand-computed blocks of the types whose fields are spread over several bytes (bit-exactness
//! against gguf-py over random blocks is tests/test_dequant.py), and the IQ grids' GPU layout.

use qk::gguf::GgmlType;
use qk::gguf::dequant::dequantize;
use qk::gguf::grids::grid_of;

fn h(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_le_bytes()
}

#[test]
fn dequant_hand_computed_new_types() {
    // Q3_K, d = 0.5: scale 0 = low nibble 3 of byte 0, high bits 01 of byte 8 → 19 − 32 = −13;
    // weight 0: qs bits 0..1 = 2, hmask bit 0 set (no −4) → 2; weight 1: hmask bit clear → 2 − 4.
    let mut b = vec![0u8; 110];
    b[0] = 1; // hmask[0] bit 0: weight 0
    b[32] = 2;
    b[33] = 2;
    b[96] = 3;
    b[104] = 1;
    b[108..110].copy_from_slice(&h(0.5));
    let y = dequantize(GgmlType::Q3K, &b, 256).expect("q3_k");
    assert_eq!((y[0], y[1]), (0.5 * -13.0 * 2.0, 0.5 * -13.0 * -2.0));

    // IQ1_M: d = 1.5 (f16 0x3e00) spread over the top nibbles of the scale words, lowest nibble
    // first; scale 0 = 2 → dl = 1.5·5; grid entry 0 is all −1, delta +1/8 → −0.875·7.5.
    let mut b = vec![0u8; 56];
    let bits = half::f16::from_f32(1.5).to_bits();
    for k in 0..4 {
        let word = ((bits >> (4 * k)) & 15) << 12 | if k == 0 { 2 } else { 0 };
        b[48 + 2 * k..50 + 2 * k].copy_from_slice(&word.to_le_bytes());
    }
    let y = dequantize(GgmlType::IQ1M, &b, 256).expect("iq1_m");
    assert_eq!(y[0], 7.5 * -0.875);
    assert_eq!(y[16], 1.5 * -0.875, "group 2 has scale 1 of the word: 0 → dl = d");

    // MXFP4: e = 128 → d = 2^(128 − 128) = 1; nibble 7 → 12, nibble 15 → −12.
    let mut b = vec![128u8];
    b.extend([0xf7u8; 16]);
    let y = dequantize(GgmlType::MXFP4, &b, 32).expect("mxfp4");
    assert_eq!((y[0], y[16]), (12.0, -12.0));
}

#[test]
fn wgsl_grid_sizes_match_the_uploaded_grids() {
    // The kernels find a grid by its size in words, counted back from the end of the W binding.
    let wgsl = include_str!("../../shaders/common_dequant.wgsl");
    for (ty, name) in [
        (GgmlType::IQ2XXS, "IQ2XXS"),
        (GgmlType::IQ2XS, "IQ2XS"),
        (GgmlType::IQ2S, "IQ2S"),
        (GgmlType::IQ3XXS, "IQ3XXS"),
        (GgmlType::IQ3S, "IQ3S"),
        (GgmlType::IQ1S, "IQ1S"),
    ] {
        let words = grid_of(ty).expect("an IQ grid").len() / 2;
        let decl = format!("const {name}_WORDS = {words}u;");
        assert!(wgsl.contains(&decl), "common_dequant.wgsl lacks {decl:?}");
    }
    assert_eq!(grid_of(GgmlType::IQ1M), grid_of(GgmlType::IQ1S));
    let with_grid: Vec<_> = GgmlType::ALL
        .into_iter()
        .filter(|&t| grid_of(t).is_some())
        .collect();
    assert_eq!(with_grid.len(), 7, "{with_grid:?}");
}
