//! Embedding lookup from a resident (possibly quantised) token_embd: rows gathered by token ids in a
//! GPU buffer and dequantised on the fly, so no f32 copy of the table is ever made.

use super::matmul::{Columns, qtype_name};
use crate::error::{QkError, Result};
use crate::gpu::{Gpu, GpuBuffer, Recorder, ShaderFile, WeightTensor};

pub const EMBED: ShaderFile = crate::shader_file!("embed", EmbedParams);
const EMBED_WG: u32 = 64;

crate::gpu_params! {
    struct EmbedParams {
        k: u32,
        row_bytes: u32,
        /// Rows first_row .. first_row + n_rows of the table are in this window's binding.
        first_row: u32,
        n_rows: u32,
        /// Token t's id at IDS[ids_offset + t * ids_stride] (a stride of 2k reads the ids of a previous
        /// step's top-k (id, logit) rows: a chained decode step).
        ids_offset: u32,
        ids_stride: u32,
        /// OUT[out_offset + t * out_stride + i] (floats; multiples of 4).
        out_offset: u32,
        out_stride: u32,
    }
}

/// Where the token ids of an embedding lookup are: token t's id at word `offset + t * stride` of
/// `buf` (stride 1: ids written by the host; 2k: the top-k rows of a previous decode step).
#[derive(Clone, Copy)]
pub struct Ids<'a> {
    pub buf: &'a GpuBuffer,
    pub offset: u32,
    pub stride: u32,
}

impl<'a> Ids<'a> {
    pub fn packed(buf: &'a GpuBuffer) -> Ids<'a> {
        Ids {
            buf,
            offset: 0,
            stride: 1,
        }
    }
}

/// Record out[:, t] = table row of id t for t < n_tokens. Ids ≥ the table's row count produce no
/// write (the caller validates token ids on the host when they arrive).
pub fn embed(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    table: &WeightTensor,
    ids: Ids<'_>,
    n_tokens: u32,
    out: Columns<'_>,
) -> Result<()> {
    let k = u32::try_from(table.cols).map_err(|_| QkError::Engine("embedding width exceeds u32".into()))?;
    if !out.offset.is_multiple_of(4) || !out.stride.is_multiple_of(4) {
        return Err(QkError::Engine(
            "embed: output offset and stride must be multiples of 4".into(),
        ));
    }
    let end =
        (u64::from(out.offset) + u64::from(n_tokens.max(1) - 1) * u64::from(out.stride) + table.cols) * 4;
    let ids_end = u64::from(ids.offset) + u64::from(n_tokens.max(1) - 1) * u64::from(ids.stride) + 1;
    if end > out.buf.size || ids.stride == 0 || ids_end * 4 > ids.buf.size {
        return Err(QkError::Engine(format!(
            "embed {}: output or ids buffer too small for {n_tokens} tokens",
            table.name
        )));
    }
    let pipe = gpu.pipeline(
        &EMBED,
        &[
            ("QTYPE", qtype_name(table.ty).into()),
            ("WG", EMBED_WG.to_string()),
        ],
        &[],
    )?;
    let groups = (k / 8).div_ceil(EMBED_WG);
    let max = gpu.caps.max_workgroups_per_dim;
    let mut first = 0u32;
    while first < n_tokens {
        let count = (n_tokens - first).min(max);
        for win in &table.windows {
            let p = EmbedParams {
                k,
                row_bytes: table.row_bytes as u32,
                first_row: win.first_row as u32,
                n_rows: win.n_rows as u32,
                ids_offset: ids.offset + first * ids.stride,
                ids_stride: ids.stride,
                out_offset: out.offset + first * out.stride,
                out_stride: out.stride,
            };
            rec.dispatch(
                &pipe,
                &[win.buffer.all(), ids.buf.all(), out.buf.all()],
                bytemuck::bytes_of(&p),
                [groups, count, 1],
            )?;
        }
        first += count;
    }
    Ok(())
}
