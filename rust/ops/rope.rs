//! Partial NeoX rotary embedding (shaders/rope.wgsl), in place over (token, head) rows, and its CPU
//! reference.

use bytemuck::{Pod, Zeroable};

pub const SHADER_NAME: &str = "rope";
pub const SHADER_SOURCE: &str = include_str!("../../shaders/rope.wgsl");
pub const ENTRY_POINT: &str = "rope_neox";
/// Invocations per workgroup in rope.wgsl (one invocation per rotated pair).
pub const WORKGROUP: u32 = 64;

/// Mirrors `RopeParams` in rope.wgsl. Row (t, h) starts at `offset + t*token_stride + h*head_stride`;
/// token t is at position `pos_base + t`, or `pos_base + positions[t]` if `pos_from_buffer != 0`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct RopeParams {
    pub tokens: u32,
    pub heads: u32,
    pub n_rot: u32,
    pub pos_from_buffer: u32,
    pub offset: u32,
    pub token_stride: u32,
    pub head_stride: u32,
    pub pos_base: u32,
    pub theta_base: f32,
    pub _pad0: u32,
    pub _pad1: u32,
    pub _pad2: u32,
}

impl RopeParams {
    /// Invocations the kernel needs (one per rotated pair).
    pub fn invocations(&self) -> u32 {
        self.tokens * self.heads * (self.n_rot / 2)
    }
}

pub mod reference {
    use super::RopeParams;

    /// Rotates `x` in place. The angle is the f32 product pos * theta (as llama.cpp and the shader
    /// round it); theta, cos and sin are evaluated in f64.
    pub fn rope(p: &RopeParams, x: &mut [f32], positions: &[u32]) {
        let half = (p.n_rot / 2) as usize;
        for t in 0..p.tokens as usize {
            let pos = p.pos_base
                + if p.pos_from_buffer != 0 {
                    positions[t]
                } else {
                    t as u32
                };
            for h in 0..p.heads as usize {
                let base = p.offset as usize + t * p.token_stride as usize + h * p.head_stride as usize;
                for i in 0..half {
                    let theta = (p.theta_base as f64).powf(-2.0 * i as f64 / p.n_rot as f64) as f32;
                    let angle = (pos as f32 * theta) as f64;
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
