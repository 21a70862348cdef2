//! MoE router on the GPU (shaders/router.wgsl): softmax, top-k with ties to the lowest id,
//! renormalised weights; and its CPU reference.

use bytemuck::{Pod, Zeroable};

use super::elementwise::require_len;
use crate::gpu::{Gpu, GpuBuffer, Recorder, ShaderFile};

pub const FILE: ShaderFile = crate::shader_file!("router", RouterImmediates);
/// Limits of the shader's workgroup arrays (`MAX_EXPERTS`, `MAX_K`).
pub const MAX_EXPERTS: u32 = 1024;
pub const MAX_K: u32 = 32;
/// llama.cpp clamps the sum of the chosen probabilities to at least this before dividing.
pub const MIN_WEIGHT_SUM: f32 = 6.1e-5;

/// A routing call's shape (the kernel's immediates add the outputs' layout). Logits of token t at `logits_offset + t*logits_token_stride`;
/// ids and weights are written at `t*k + i`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct RouterParams {
    pub tokens: u32,
    pub experts: u32,
    pub k: u32,
    pub logits_offset: u32,
    pub logits_token_stride: u32,
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

/// The token's shared expert as its pick k (router.wgsl `SHARED`): expert `id` (its rows appended
/// to the expert tensors), weighted by sigmoid of its gate logit, token t's at
/// `gate_offset + t·gate_stride` of `gate`.
#[derive(Clone, Copy, Debug)]
pub struct SharedSlot<'a> {
    pub id: u32,
    pub gate: &'a GpuBuffer,
    pub gate_offset: u32,
    pub gate_stride: u32,
}

crate::gpu_params! {
    /// The kernel's immediates: [`RouterParams`]' fields, then the output stride and shared slot.
    struct RouterImmediates {
        tokens: u32,
        experts: u32,
        k: u32,
        logits_offset: u32,
        logits_token_stride: u32,
        /// Ids (and weights) per token in the outputs: k, or k + 1 with the shared slot.
        ids_stride: u32,
        /// SHARED: the shared expert's id and its gate logit of token t at gate_offset + t ·
        /// gate_stride.
        shared_id: u32,
        gate_offset: u32,
        gate_stride: u32,
    }
}

/// Record routing of `p.tokens` tokens: `ids` (u32) and `weights` (f32) get k entries per token.
pub fn record(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    p: &RouterParams,
    logits: &GpuBuffer,
    ids: &GpuBuffer,
    weights: &GpuBuffer,
) -> crate::Result<()> {
    record_with(gpu, rec, p, logits, ids, weights, None)
}

/// [`record`], with the shared expert as pick k when `shared` is given (k + 1 entries per token).
pub fn record_with(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    p: &RouterParams,
    logits: &GpuBuffer,
    ids: &GpuBuffer,
    weights: &GpuBuffer,
    shared: Option<SharedSlot<'_>>,
) -> crate::Result<()> {
    p.validate()?;
    let ids_stride = p.k + u32::from(shared.is_some());
    if p.tokens > 0 {
        let last =
            p.logits_offset as u64 + (p.tokens as u64 - 1) * p.logits_token_stride as u64 + p.experts as u64;
        require_len("router logits", logits, last)?;
        if let Some(s) = &shared {
            let gate_end = u64::from(s.gate_offset) + (p.tokens as u64 - 1) * u64::from(s.gate_stride) + 1;
            require_len("router shared gate", s.gate, gate_end)?;
        }
    }
    require_len("router ids", ids, p.tokens as u64 * ids_stride as u64)?;
    require_len("router weights", weights, p.tokens as u64 * ids_stride as u64)?;
    let mut defines = vec![("SHARED", u32::from(shared.is_some()).to_string())];
    if let Some(sg) = crate::ops::matmul::route_lanes(gpu, p.experts) {
        defines.push(("SG", sg.to_string()));
        defines.push(("RSG", sg.to_string()));
        defines.push(("WG", sg.to_string()));
        defines.push(("PER_LANE", p.experts.div_ceil(sg).to_string()));
    }
    let pipe = gpu.pipeline(&FILE, &defines, &[])?;
    let kp = RouterImmediates {
        tokens: p.tokens,
        experts: p.experts,
        k: p.k,
        logits_offset: p.logits_offset,
        logits_token_stride: p.logits_token_stride,
        ids_stride,
        shared_id: shared.map_or(0, |s| s.id),
        gate_offset: shared.map_or(0, |s| s.gate_offset),
        gate_stride: shared.map_or(0, |s| s.gate_stride),
    };
    let mut bindings = vec![logits.all(), ids.all(), weights.all()];
    if let Some(s) = &shared {
        bindings.push(s.gate.all());
    }
    rec.dispatch(&pipe, &bindings, bytemuck::bytes_of(&kp), gpu.grid(p.tokens))
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
