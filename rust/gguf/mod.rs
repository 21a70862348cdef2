//! GGUF: the mmap reader, split shards, ggml block formats and CPU dequantisation.

pub mod dequant;
pub mod types;

pub use types::GgmlType;
