//! ggml tensor types: ids as stored in GGUF, block sizes and byte sizes
//! (ggml-common.h static_asserts; gguf-py constants.py GGML_QUANT_SIZES).

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
    IQ4NL,
    IQ4XS,
    BF16,
}

impl GgmlType {
    /// Every type qk reads, for iteration in tests.
    pub const ALL: [GgmlType; 10] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::IQ4NL,
        GgmlType::IQ4XS,
        GgmlType::BF16,
    ];

    /// The GGUF type id → type; `None` for ids qk does not read.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            20 => GgmlType::IQ4NL,
            23 => GgmlType::IQ4XS,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q8_0 => 8,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::IQ4NL => 20,
            GgmlType::IQ4XS => 23,
            GgmlType::BF16 => 30,
        }
    }

    /// Weights per block.
    pub fn block_len(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q8_0 | GgmlType::IQ4NL => 32,
            GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K | GgmlType::IQ4XS => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 | GgmlType::IQ4NL => 18,
            GgmlType::Q8_0 => 34,
            GgmlType::Q4K => 144,
            GgmlType::Q5K => 176,
            GgmlType::Q6K => 210,
            GgmlType::IQ4XS => 136,
        }
    }

    /// Bytes of `n` weights, or `None` if `n` is not a whole number of blocks or overflows.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let bl = self.block_len() as u64;
        if n % bl != 0 {
            return None;
        }
        (n / bl).checked_mul(self.block_bytes() as u64)
    }

    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
            GgmlType::IQ4NL => "IQ4_NL",
            GgmlType::IQ4XS => "IQ4_XS",
            GgmlType::BF16 => "BF16",
        }
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Non-linear 4-bit codebook shared by IQ4_NL and IQ4_XS (ggml-common.h kvalues_iq4nl).
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];
