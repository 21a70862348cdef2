//! Causal GQA attention with the sigmoid output gate (shaders/attention.wgsl): split-K decode plus
//! its reduce pass, and tiled prefill; the CPU reference. The KV cache layout (token-major rows of
//! kv_heads * head_dim per position, K and V in separate buffers) is documented in the shader.

use bytemuck::{Pod, Zeroable};

use super::elementwise::require_len;
use crate::gpu::{Gpu, GpuBuffer, Recorder, ShaderFile};

pub const FILE: ShaderFile = crate::shader_file!("attention");
/// Query rows per prefill workgroup (`BQ`).
pub const PREFILL_ROWS: u32 = 16;
/// Limits of the shader's workgroup arrays (`MAX_GROUP`, `MAX_GROUP_Q`, `MAX_SCORES`, prefill
/// `LANES * MAX_DIMS_PER_LANE`).
pub const MAX_GROUP: u32 = 16;
pub const MAX_GROUP_Q: u32 = 2048;
pub const MAX_SCORES: u32 = 1024;
/// Decode splits aimed for: enough workgroups (× kv heads) to fill a large GPU.
pub const DECODE_SPLITS_TARGET: u32 = 64;
/// Fewest cache positions per decode split (each split is a workgroup's fixed start-up cost).
pub const MIN_SPLIT_LEN: u32 = 16;
pub const MAX_HEAD_DIM: u32 = 256;

/// Mirrors `AttnParams` in attention.wgsl.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct AttnParams {
    pub tokens: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub q_pos: u32,
    pub q_offset: u32,
    pub q_token_stride: u32,
    pub q_head_stride: u32,
    pub gate_offset: u32,
    pub gate_token_stride: u32,
    pub gate_head_stride: u32,
    pub kv_offset: u32,
    pub out_offset: u32,
    pub out_token_stride: u32,
    pub splits: u32,
    pub split_len: u32,
    pub scale: f32,
    pub gated: u32,
}

impl AttnParams {
    /// Cache positions per decode split: as many as the shared score array allows for one group
    /// (128 for the 8 q heads per kv head of the reference models).
    pub fn decode_split_len(heads: u32, kv_heads: u32) -> u32 {
        (MAX_SCORES / (heads / kv_heads).max(1)).min(256)
    }

    /// Fills `splits` / `split_len` for a decode dispatch over the longest row's cache: about
    /// `DECODE_SPLITS_TARGET` splits of at least `MIN_SPLIT_LEN` positions, up to the score array's
    /// limit. A fixed 128-position split left a short cache to a handful of workgroups, each walking
    /// hundreds of positions serially (820 µs per layer at 576 positions on the H200). The split
    /// depends only on the longest row's cache length, so a row's result is the same however a
    /// prompt is cut at multiples of 64, and in a step as in a single-token run.
    pub fn with_decode_splits(mut self) -> Self {
        let kv_len = self.q_pos + self.tokens;
        self.split_len = Self::split_len_for(kv_len, self.heads, self.kv_heads);
        self.splits = kv_len.div_ceil(self.split_len);
        self
    }

    fn split_len_for(kv_len: u32, heads: u32, kv_heads: u32) -> u32 {
        let cap = Self::decode_split_len(heads, kv_heads);
        let wanted = kv_len.div_ceil(DECODE_SPLITS_TARGET).next_power_of_two();
        wanted.clamp(MIN_SPLIT_LEN.min(cap), cap)
    }

    /// The most splits any decode dispatch with a cache of at most `ctx` positions uses (the
    /// scratch for partial results is sized by it).
    pub fn max_decode_splits(heads: u32, kv_heads: u32, ctx: u32) -> u32 {
        let cap = Self::decode_split_len(heads, kv_heads);
        let small = MIN_SPLIT_LEN.min(cap);
        // Below the cap the count stays within the target (or within ctx / small for short caches);
        // at the cap it grows with the cache.
        ctx.div_ceil(small)
            .min(DECODE_SPLITS_TARGET.max(ctx.div_ceil(cap)))
    }

    /// Checks the shapes against the shader's fixed-size arrays.
    pub fn validate(&self) -> crate::Result<()> {
        use crate::QkError;
        let group = self.heads.checked_div(self.kv_heads).unwrap_or(0);
        crate::ensure!(
            self.kv_heads > 0 && group * self.kv_heads == self.heads && group <= MAX_GROUP,
            QkError::Engine(format!(
                "attention: {} heads over {} kv heads",
                self.heads, self.kv_heads
            ))
        );
        crate::ensure!(
            self.head_dim <= MAX_HEAD_DIM && group * self.head_dim <= MAX_GROUP_Q,
            QkError::Engine(format!("attention: head_dim {} too large", self.head_dim))
        );
        Ok(())
    }
}

/// The operands of an attention dispatch. `gate` may be any buffer when `gated == 0`.
pub struct AttnArgs<'a> {
    pub q: &'a GpuBuffer,
    pub gate: &'a GpuBuffer,
    pub k_cache: &'a GpuBuffer,
    pub v_cache: &'a GpuBuffer,
    pub out: &'a GpuBuffer,
}

fn check(p: &AttnParams, args: &AttnArgs<'_>) -> crate::Result<()> {
    p.validate()?;
    if p.tokens == 0 {
        return Ok(());
    }
    let (t, h) = (p.tokens as u64 - 1, p.heads as u64 - 1);
    let hd = p.head_dim as u64;
    require_len(
        "attention q",
        args.q,
        p.q_offset as u64 + t * p.q_token_stride as u64 + h * p.q_head_stride as u64 + hd,
    )?;
    if p.gated != 0 {
        let last = p.gate_offset as u64 + t * p.gate_token_stride as u64 + h * p.gate_head_stride as u64 + hd;
        require_len("attention gate", args.gate, last)?;
    }
    let kv = p.kv_offset as u64 + (p.q_pos as u64 + p.tokens as u64) * p.kv_heads as u64 * hd;
    require_len("attention k cache", args.k_cache, kv)?;
    require_len("attention v cache", args.v_cache, kv)?;
    require_len(
        "attention out",
        args.out,
        p.out_offset as u64 + t * p.out_token_stride as u64 + (h + 1) * hd,
    )
}

/// Record tiled causal prefill attention for `p.tokens` query rows.
pub fn record_prefill(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    p: &AttnParams,
    args: &AttnArgs<'_>,
) -> crate::Result<()> {
    check(p, args)?;
    let pipe = gpu.pipeline(&FILE, &[("OP", "prefill".into())], &[])?;
    rec.dispatch(
        &pipe,
        &[
            args.q.all(),
            args.gate.all(),
            args.k_cache.all(),
            args.v_cache.all(),
            args.out.all(),
        ],
        bytemuck::bytes_of(p),
        [p.tokens.div_ceil(PREFILL_ROWS), p.heads, 1],
    )
}

/// f32 counts of the decode scratch buffers (partial outputs, max/sum pairs) for `p`
/// (after [`AttnParams::with_decode_splits`]).
pub fn decode_scratch_len(p: &AttnParams) -> (u64, u64) {
    let slots = p.tokens as u64 * p.heads as u64 * p.splits as u64;
    (slots * p.head_dim as u64, slots * 2)
}

/// Record split-K decode attention (few query rows, any cache length): the split pass and the
/// reduce pass. `p` must carry `splits`/`split_len` (see [`AttnParams::with_decode_splits`]).
pub fn record_decode(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    p: &AttnParams,
    args: &AttnArgs<'_>,
    partial_out: &GpuBuffer,
    partial_ml: &GpuBuffer,
) -> crate::Result<()> {
    check(p, args)?;
    let group = p.heads / p.kv_heads;
    crate::ensure!(
        p.split_len > 0
            && group * p.split_len <= MAX_SCORES
            && p.splits as u64 * p.split_len as u64 >= p.q_pos as u64 + p.tokens as u64,
        crate::QkError::Engine(format!(
            "attention decode: {} splits of {} do not fit",
            p.splits, p.split_len
        ))
    );
    let (po, pml) = decode_scratch_len(p);
    require_len("attention partial out", partial_out, po)?;
    require_len("attention partial max/sum", partial_ml, pml)?;
    let split = gpu.pipeline(&FILE, &[("OP", "split".into())], &[])?;
    rec.dispatch(
        &split,
        &[
            args.q.all(),
            args.k_cache.all(),
            args.v_cache.all(),
            partial_out.all(),
            partial_ml.all(),
        ],
        bytemuck::bytes_of(p),
        [p.splits, p.kv_heads, p.tokens],
    )?;
    let reduce = gpu.pipeline(&FILE, &[("OP", "reduce".into())], &[])?;
    rec.dispatch(
        &reduce,
        &[
            args.gate.all(),
            partial_out.all(),
            partial_ml.all(),
            args.out.all(),
        ],
        bytemuck::bytes_of(p),
        [p.heads, p.tokens, 1],
    )
}

pub mod reference {
    use super::AttnParams;

    /// f64 attention over `k_cache` / `v_cache` (layout of the shader), gated if `p.gated != 0`.
    pub fn attention(
        p: &AttnParams,
        q: &[f32],
        gate: &[f32],
        k_cache: &[f32],
        v_cache: &[f32],
        out: &mut [f32],
    ) {
        let hd = p.head_dim as usize;
        let group = (p.heads / p.kv_heads) as usize;
        let kv =
            |p_: usize, g: usize, d: usize| p.kv_offset as usize + (p_ * p.kv_heads as usize + g) * hd + d;
        for t in 0..p.tokens as usize {
            let len = p.q_pos as usize + t + 1;
            for h in 0..p.heads as usize {
                let g = h / group;
                let qb = p.q_offset as usize + t * p.q_token_stride as usize + h * p.q_head_stride as usize;
                let scores: Vec<f64> = (0..len)
                    .map(|pos| {
                        (0..hd)
                            .map(|d| q[qb + d] as f64 * k_cache[kv(pos, g, d)] as f64)
                            .sum::<f64>()
                            * p.scale as f64
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let l: f64 = e.iter().sum();
                for d in 0..hd {
                    let o: f64 = (0..len)
                        .map(|pos| e[pos] * v_cache[kv(pos, g, d)] as f64)
                        .sum::<f64>()
                        / l;
                    let gate_factor = if p.gated != 0 {
                        let z = gate[p.gate_offset as usize
                            + t * p.gate_token_stride as usize
                            + h * p.gate_head_stride as usize
                            + d] as f64;
                        1.0 / (1.0 + (-z).exp())
                    } else {
                        1.0
                    };
                    out[p.out_offset as usize + t * p.out_token_stride as usize + h * hd + d] =
                        (o * gate_factor) as f32;
                }
            }
        }
    }
}
