//! Partial NeoX rotary embedding (shaders/rope.wgsl), in place over (token, head) rows, and its CPU
//! reference.

use bytemuck::{Pod, Zeroable};

use super::elementwise::require_len;
use crate::gpu::{Gpu, GpuBuffer, Recorder, ShaderFile};
use crate::{QkError, Result};

pub const FILE: ShaderFile = crate::shader_file!("rope");
/// Invocations per workgroup in rope.wgsl (one invocation per rotated pair).
pub const WORKGROUP: u32 = 64;

/// Mirrors `RopeParams` in rope.wgsl. Row (t, h) starts at `offset + t*token_stride + h*head_stride`;
/// token t is at position `pos_base + t`, or `pos_base + positions[t]` when a positions buffer is
/// given.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct RopeParams {
    pub tokens: u32,
    pub heads: u32,
    pub n_rot: u32,
    pub offset: u32,
    pub token_stride: u32,
    pub head_stride: u32,
    pub pos_base: u32,
}

/// theta_i = base^(-2i/n_rot) for i < n_rot/2, evaluated in f64 and rounded once (the FREQS
/// binding; upload once per model).
pub fn freq_table(n_rot: u32, theta_base: f64) -> Vec<f32> {
    (0..n_rot / 2)
        .map(|i| theta_base.powf(-2.0 * i as f64 / n_rot as f64) as f32)
        .collect()
}

impl RopeParams {
    /// Invocations the kernel needs (one per rotated pair).
    pub fn invocations(&self) -> u32 {
        self.tokens * self.heads * (self.n_rot / 2)
    }
}

/// Record the in-place rotation of `x` with `freqs` from [`freq_table`]; `positions` (u32 per
/// token) switches to the buffer form.
pub fn record(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    p: &RopeParams,
    x: &GpuBuffer,
    freqs: &GpuBuffer,
    positions: Option<&GpuBuffer>,
) -> Result<()> {
    crate::ensure!(
        p.n_rot.is_multiple_of(2) && p.n_rot > 0 && (p.n_rot <= p.head_stride || p.heads == 1),
        QkError::Engine(format!("rope: n_rot {} must be even and fit a head", p.n_rot))
    );
    if p.tokens > 0 && p.heads > 0 {
        let last = p.offset as u64
            + (p.tokens as u64 - 1) * p.token_stride as u64
            + (p.heads as u64 - 1) * p.head_stride as u64
            + p.n_rot as u64;
        require_len("rope", x, last)?;
    }
    let pipe = gpu.pipeline(
        &FILE,
        &[("POSITIONS", (positions.is_some() as u32).to_string())],
        &[],
    )?;
    require_len("rope freqs", freqs, p.n_rot as u64 / 2)?;
    let mut bindings = vec![x.all(), freqs.all()];
    if let Some(pos) = positions {
        require_len("rope positions", pos, p.tokens as u64)?;
        bindings.push(pos.all());
    }
    rec.dispatch(
        &pipe,
        &bindings,
        bytemuck::bytes_of(p),
        gpu.grid(p.invocations().div_ceil(WORKGROUP)),
    )
}

pub mod reference {
    use super::RopeParams;

    /// Rotates `x` in place. The angle is the f32 product pos * freqs[i] (as llama.cpp and the
    /// shader round it); cos and sin are evaluated in f64.
    pub fn rope(p: &RopeParams, x: &mut [f32], freqs: &[f32], positions: Option<&[u32]>) {
        let half = (p.n_rot / 2) as usize;
        for t in 0..p.tokens as usize {
            let pos = p.pos_base + positions.map_or(t as u32, |ps| ps[t]);
            for h in 0..p.heads as usize {
                let base = p.offset as usize + t * p.token_stride as usize + h * p.head_stride as usize;
                for i in 0..half {
                    let angle = (pos as f32 * freqs[i]) as f64;
                    let (s, c) = angle.sin_cos();
                    let x0 = x[base + i] as f64;
                    let x1 = x[base + i + half] as f64;
                    x[base + i] = (x0 * c - x1 * s) as f32;
                    x[base + i + half] = (x0 * s + x1 * c) as f32;
                }
            }
        }
    }
}
