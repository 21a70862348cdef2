//! MoE router on the GPU (shaders/router.wgsl): softmax, top-k with ties to the lowest id,
//! renormalised weights; and its CPU reference.

use bytemuck::{Pod, Zeroable};

pub const SHADER_NAME: &str = "router";
pub const SHADER_SOURCE: &str = include_str!("../../shaders/router.wgsl");
pub const ENTRY_POINT: &str = "router_topk";
/// Limits of the shader's workgroup arrays (`MAX_EXPERTS`, `MAX_K`).
pub const MAX_EXPERTS: u32 = 1024;
pub const MAX_K: u32 = 32;
/// llama.cpp clamps the sum of the chosen probabilities to at least this before dividing.
pub const MIN_WEIGHT_SUM: f32 = 6.1e-5;

/// Mirrors `RouterParams` in router.wgsl. Logits of token t at `logits_offset + t*logits_token_stride`;
/// ids and weights are written at `t*k + i`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct RouterParams {
    pub tokens: u32,
    pub experts: u32,
    pub k: u32,
    pub logits_offset: u32,
    pub logits_token_stride: u32,
    pub _pad0: u32,
    pub _pad1: u32,
    pub _pad2: u32,
}

impl RouterParams {
    pub fn validate(&self) -> crate::Result<()> {
        crate::ensure!(
            self.experts <= MAX_EXPERTS && self.k >= 1 && self.k <= MAX_K.min(self.experts),
            crate::QkError::Engine(format!("router: top-{} of {} experts", self.k, self.experts))
        );
        Ok(())
    }
}

pub mod reference {
    use super::{MIN_WEIGHT_SUM, RouterParams};

    /// Returns (ids, weights), k per token.
    pub fn route(p: &RouterParams, logits: &[f32]) -> (Vec<u32>, Vec<f32>) {
        let mut ids = Vec::new();
        let mut weights = Vec::new();
        for t in 0..p.tokens as usize {
            let row = &logits[p.logits_offset as usize + t * p.logits_token_stride as usize..]
                [..p.experts as usize];
            let m = row
                .iter()
                .cloned()
                .fold(f64::NEG_INFINITY, |a, b| a.max(b as f64));
            let e: Vec<f64> = row.iter().map(|x| (*x as f64 - m).exp()).collect();
            let total: f64 = e.iter().sum();
            let mut order: Vec<usize> = (0..row.len()).collect();
            // Stable sort keeps the lowest id first among equal probabilities.
            order.sort_by(|a, b| e[*b].total_cmp(&e[*a]));
            let chosen = &order[..p.k as usize];
            let sum = chosen
                .iter()
                .map(|i| e[*i] / total)
                .sum::<f64>()
                .max(MIN_WEIGHT_SUM as f64);
            for i in chosen {
                ids.push(*i as u32);
                weights.push((e[*i] / total / sum) as f32);
            }
        }
        (ids, weights)
    }
}
