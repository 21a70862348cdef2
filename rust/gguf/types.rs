//! ggml tensor types: ids as stored in GGUF, block sizes and byte sizes
//! (ggml-common.h static_asserts; gguf-py constants.py GGML_QUANT_SIZES).

use std::fmt;

/// The ggml weight types qk reads and dequantises: every type llama.cpp's quantiser writes for the
/// Qwen3-Next / Qwen3.5-MoE recipes (ternary, NVFP4 and the 1/2-bit Q1_0/Q2_0 excepted).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    IQ1S,
    IQ1M,
    IQ2XXS,
    IQ2XS,
    IQ2S,
    IQ3XXS,
    IQ3S,
    IQ4NL,
    IQ4XS,
    MXFP4,
}

impl GgmlType {
    /// Every type qk reads, for iteration in tests.
    pub const ALL: [GgmlType; 23] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::IQ1S,
        GgmlType::IQ1M,
        GgmlType::IQ2XXS,
        GgmlType::IQ2XS,
        GgmlType::IQ2S,
        GgmlType::IQ3XXS,
        GgmlType::IQ3S,
        GgmlType::IQ4NL,
        GgmlType::IQ4XS,
        GgmlType::MXFP4,
    ];

    /// The GGUF type id → type; `None` for ids qk does not read.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Self::ALL.into_iter().find(|t| t.id() == id)
    }

    /// The GGUF type id (ggml.h `enum ggml_type`).
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2K => 10,
            GgmlType::Q3K => 11,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::IQ2XXS => 16,
            GgmlType::IQ2XS => 17,
            GgmlType::IQ3XXS => 18,
            GgmlType::IQ1S => 19,
            GgmlType::IQ4NL => 20,
            GgmlType::IQ3S => 21,
            GgmlType::IQ2S => 22,
            GgmlType::IQ4XS => 23,
            GgmlType::IQ1M => 29,
            GgmlType::BF16 => 30,
            GgmlType::MXFP4 => 39,
        }
    }

    /// The size row of this type in the table of every ggml type.
    pub fn layout(self) -> TypeLayout {
        // Every id above has its row (tests/rust/gguf_tests.rs type_table_is_consistent).
        TypeLayout::of_id(self.id()).expect("every GgmlType has a row in GGML_TYPE_LAYOUTS")
    }

    /// Weights per block.
    pub fn block_len(self) -> usize {
        self.layout().block_len
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        self.layout().block_bytes
    }

    /// Bytes of `n` weights, or `None` if `n` is not a whole number of blocks or overflows.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        self.layout().bytes_for(n)
    }

    /// The ggml name ("Q4_K", "IQ2_XXS", …).
    pub fn name(self) -> &'static str {
        self.layout().name
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

/// MXFP4's E2M1 values, doubled to integers (ggml-common.h kvalues_mxfp4): the block scale is
/// taken at half its E8M0 value to match.
pub const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];
