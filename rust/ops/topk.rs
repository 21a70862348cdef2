//! Argmax and top-k (k <= 256) over a vocabulary of logits (shaders/topk.wgsl), two passes, ties to
//! the lowest id; and the CPU reference.

use bytemuck::{Pod, Zeroable};

use super::elementwise::require_len;
use crate::gpu::{Gpu, GpuBuffer, Recorder, ShaderFile};

pub const FILE: ShaderFile = crate::shader_file!("topk", TopkParams);
pub const MAX_K: u32 = 256;
/// Logits per first-pass workgroup: 16 per invocation of its 256.
pub const BLOCK_LEN: u32 = 4096;

/// One result: a token id and its logit (`Pair` in topk.wgsl).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct IdLogit {
    pub id: u32,
    pub logit: f32,
}

crate::gpu_params! {
    /// The immediates of topk.wgsl: logits [offset, offset + n) (row r: shifted by
    /// r·row_stride), ids relative to the row's start.
    pub struct TopkParams {
        pub n: u32,
        pub k: u32,
        pub offset: u32,
        pub block_len: u32,
        pub blocks: u32,
        /// Floats between the logits of consecutive rows.
        pub row_stride: u32,
    }
}

impl TopkParams {
    pub fn new(n: u32, k: u32, offset: u32) -> crate::Result<Self> {
        crate::ensure!(
            (1..=MAX_K).contains(&k) && k <= n,
            crate::QkError::Engine(format!("top-k: k = {k} over {n} logits (1 <= k <= {MAX_K})"))
        );
        Ok(TopkParams {
            n,
            k,
            offset,
            block_len: BLOCK_LEN,
            blocks: n.div_ceil(BLOCK_LEN),
            row_stride: n,
        })
    }

    /// Pairs in the candidate buffer between the passes.
    pub fn candidates(&self) -> u32 {
        self.blocks * self.k
    }
}

/// Record both passes: the k best of `logits[offset .. offset + n]` into `result` (k pairs, best
/// first), using `candidates` (at least `p.candidates()` pairs) in between.
pub fn record(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    p: &TopkParams,
    logits: &GpuBuffer,
    candidates: &GpuBuffer,
    result: &GpuBuffer,
) -> crate::Result<()> {
    record_rows(gpu, rec, p, 1, logits, candidates, result)
}

/// [`record`] for `rows` rows in the same two dispatches: row r's logits start at
/// `offset + r * row_stride`, its k pairs land at pair r·k of `result`, and `candidates` holds
/// `rows * p.candidates()` pairs.
pub fn record_rows(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    p: &TopkParams,
    rows: u32,
    logits: &GpuBuffer,
    candidates: &GpuBuffer,
    result: &GpuBuffer,
) -> crate::Result<()> {
    let rows64 = u64::from(rows);
    crate::ensure!(
        rows >= 1 && rows <= gpu.caps.max_workgroups_per_dim && (rows == 1 || p.row_stride >= p.n),
        crate::QkError::Engine(format!(
            "top-k over {rows} rows of stride {} (n = {})",
            p.row_stride, p.n
        ))
    );
    require_len(
        "top-k logits",
        logits,
        p.offset as u64 + (rows64 - 1) * p.row_stride as u64 + p.n as u64,
    )?;
    require_len("top-k candidates", candidates, 2 * rows64 * p.candidates() as u64)?;
    require_len("top-k result", result, 2 * rows64 * p.k as u64)?;
    crate::ensure!(
        p.blocks <= gpu.caps.max_workgroups_per_dim,
        crate::QkError::Engine(format!("top-k: {} blocks exceed one grid row", p.blocks))
    );
    let block = gpu.pipeline(&FILE, &[("OP", "block".into())], &[])?;
    rec.dispatch(
        &block,
        &[logits.all(), candidates.all()],
        bytemuck::bytes_of(p),
        [p.blocks, 1, rows],
    )?;
    let merge = gpu.pipeline(&FILE, &[("OP", "merge".into())], &[])?;
    rec.dispatch(
        &merge,
        &[candidates.all(), result.all()],
        bytemuck::bytes_of(p),
        [1, 1, rows],
    )
}

pub mod reference {
    use super::IdLogit;

    /// The k best (logit desc, id asc); NaN sorts last like in the shader.
    pub fn top_k(logits: &[f32], k: usize) -> Vec<IdLogit> {
        let key = |x: f32| if x.is_nan() { f32::MIN } else { x };
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        ids.sort_by(|a, b| {
            key(logits[*b as usize])
                .total_cmp(&key(logits[*a as usize]))
                .then(a.cmp(b))
        });
        ids.into_iter()
            .take(k)
            .map(|id| IdLogit {
                id,
                logit: key(logits[id as usize]),
            })
            .collect()
    }
}
