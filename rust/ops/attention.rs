//! Causal GQA attention with the sigmoid output gate (shaders/attention.wgsl): split-K decode plus
//! its reduce pass, and tiled prefill; the CPU reference. The KV cache layout (token-major rows of
//! kv_heads * head_dim per position, K and V in separate buffers) is documented in the shader.

use bytemuck::{Pod, Zeroable};

pub const SHADER_NAME: &str = "attention";
pub const SHADER_SOURCE: &str = include_str!("../../shaders/attention.wgsl");
pub const DECODE_SPLIT_ENTRY: &str = "attn_decode_split";
pub const DECODE_REDUCE_ENTRY: &str = "attn_decode_reduce";
pub const PREFILL_ENTRY: &str = "attn_prefill";
/// Query rows per prefill workgroup (`BQ`).
pub const PREFILL_ROWS: u32 = 16;
/// Limits of the shader's workgroup arrays (`MAX_GROUP`, `MAX_GROUP_Q`, `MAX_SCORES`, prefill
/// `LANES * MAX_DIMS_PER_LANE`).
pub const MAX_GROUP: u32 = 16;
pub const MAX_GROUP_Q: u32 = 2048;
pub const MAX_SCORES: u32 = 1024;
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
    pub _pad0: u32,
    pub _pad1: u32,
}

impl AttnParams {
    /// Cache positions per decode split: as many as the shared score array allows for one group.
    pub fn decode_split_len(heads: u32, kv_heads: u32) -> u32 {
        (MAX_SCORES / (heads / kv_heads)).min(256)
    }

    /// Fills `splits` / `split_len` for a decode dispatch over the longest row's cache.
    pub fn with_decode_splits(mut self) -> Self {
        self.split_len = Self::decode_split_len(self.heads, self.kv_heads);
        let kv_len = self.q_pos + self.tokens;
        self.splits = kv_len.div_ceil(self.split_len);
        self
    }

    /// Checks the shapes against the shader's fixed-size arrays.
    pub fn validate(&self) -> crate::Result<()> {
        use crate::QkError;
        let group = if self.kv_heads == 0 {
            0
        } else {
            self.heads / self.kv_heads
        };
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
