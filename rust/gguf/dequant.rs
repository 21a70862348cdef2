//! CPU dequantisation of every ggml type qk reads: the ground truth for the GPU kernels.

use super::types::GgmlType;
use crate::error::{QkError, Result};

/// Dequantise `n` weights of type `ty` stored in `data` (exactly `ty.bytes_for(n)` bytes) to f32.
pub fn dequantize(ty: GgmlType, data: &[u8], n: usize) -> Result<Vec<f32>> {
    let _ = (ty, data, n);
    Err(QkError::Engine("dequantize: not implemented yet".into()))
}
