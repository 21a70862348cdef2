//! ggml tensor types: ids as stored in GGUF, block sizes and byte sizes
//! (ggml-common.h static_asserts; gguf-py constants.py GGML_QUANT_SIZES).

use std::fmt;

/// The ggml types qk reads and dequantises (every type seen in real Qwen GGUFs).
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
        self.layout().bytes_for(n)
    }

    /// The size row of this type in the table of every ggml type.
    pub fn layout(self) -> TypeLayout {
        TypeLayout {
            id: self.id(),
            name: self.name(),
            block_len: self.block_len(),
            block_bytes: self.block_bytes(),
        }
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

/// Name and block geometry of any ggml type id, including those qk cannot dequantise: a file that
/// holds them still has offsets that can be validated and a table `qk.info` can list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TypeLayout {
    pub id: u32,
    pub name: &'static str,
    pub block_len: usize,
    pub block_bytes: usize,
}

impl TypeLayout {
    /// The layout of GGUF type id `id`, or `None` for ids ggml does not define (retired ids 4, 5,
    /// 31–33, 36–38 included: no current writer produces them and their sizes are not defined).
    pub fn of_id(id: u32) -> Option<TypeLayout> {
        GGML_TYPE_LAYOUTS.iter().copied().find(|l| l.id == id)
    }

    /// Bytes of `n` weights, or `None` if `n` is not a whole number of blocks or overflows.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let bl = self.block_len as u64;
        if !n.is_multiple_of(bl) {
            return None;
        }
        (n / bl).checked_mul(self.block_bytes as u64)
    }

    /// The type qk dequantises, if this is one.
    pub fn supported(self) -> Option<GgmlType> {
        GgmlType::from_id(self.id)
    }
}

const fn row(id: u32, name: &'static str, block_len: usize, block_bytes: usize) -> TypeLayout {
    TypeLayout {
        id,
        name,
        block_len,
        block_bytes,
    }
}

/// QK_K: weights per super-block of the k-quants and i-quants.
const QK_K: usize = 256;

/// Every ggml type id with its block geometry: gguf-py `GGML_QUANT_SIZES` (llama-cpp-python 0.3.36
/// sdist), which mirrors the `static_assert`s on the block structs in ggml-common.h.
pub const GGML_TYPE_LAYOUTS: [TypeLayout; 35] = [
    row(0, "F32", 1, 4),
    row(1, "F16", 1, 2),
    row(2, "Q4_0", 32, 2 + 16),
    row(3, "Q4_1", 32, 2 + 2 + 16),
    row(6, "Q5_0", 32, 2 + 4 + 16),
    row(7, "Q5_1", 32, 2 + 2 + 4 + 16),
    row(8, "Q8_0", 32, 2 + 32),
    row(9, "Q8_1", 32, 2 + 2 + 32),
    row(10, "Q2_K", QK_K, 2 + 2 + QK_K / 16 + QK_K / 4),
    row(11, "Q3_K", QK_K, 2 + QK_K / 4 + QK_K / 8 + 12),
    row(12, "Q4_K", QK_K, 2 + 2 + QK_K / 2 + 12),
    row(13, "Q5_K", QK_K, 2 + 2 + QK_K / 2 + QK_K / 8 + 12),
    row(14, "Q6_K", QK_K, 2 + QK_K / 2 + QK_K / 4 + QK_K / 16),
    row(15, "Q8_K", QK_K, 4 + QK_K + QK_K / 8),
    row(16, "IQ2_XXS", QK_K, 2 + QK_K / 4),
    row(17, "IQ2_XS", QK_K, 2 + QK_K / 4 + QK_K / 32),
    row(18, "IQ3_XXS", QK_K, 2 + QK_K / 4 + QK_K / 8),
    row(19, "IQ1_S", QK_K, 2 + QK_K / 8 + QK_K / 16),
    row(20, "IQ4_NL", 32, 2 + 16),
    row(21, "IQ3_S", QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4),
    row(22, "IQ2_S", QK_K, 2 + QK_K / 4 + QK_K / 16),
    row(23, "IQ4_XS", QK_K, 2 + 2 + QK_K / 2 + QK_K / 64),
    row(24, "I8", 1, 1),
    row(25, "I16", 1, 2),
    row(26, "I32", 1, 4),
    row(27, "I64", 1, 8),
    row(28, "F64", 1, 8),
    row(29, "IQ1_M", QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32),
    row(30, "BF16", 1, 2),
    row(34, "TQ1_0", QK_K, 2 + 4 * 13),
    row(35, "TQ2_0", QK_K, 2 + 64),
    row(39, "MXFP4", 32, 1 + 16),
    row(40, "NVFP4", 64, 4 + 32),
    row(41, "Q1_0", 128, 2 + 16),
    row(42, "Q2_0", 64, 2 + 16),
];

/// Non-linear 4-bit codebook shared by IQ4_NL and IQ4_XS (ggml-common.h kvalues_iq4nl).
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];
