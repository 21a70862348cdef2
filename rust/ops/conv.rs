//! Causal depthwise conv1d + SiLU with its (K-1)-row state (shaders/conv.wgsl), for one token or
//! many, and its CPU reference. Layouts are documented in the shader.

use bytemuck::{Pod, Zeroable};

pub const SHADER_NAME: &str = "conv";
pub const SHADER_SOURCE: &str = include_str!("../../shaders/conv.wgsl");
pub const ENTRY_POINT: &str = "conv_silu";
/// Invocations per workgroup in conv.wgsl (one invocation per channel).
pub const WORKGROUP: u32 = 64;
/// Largest tap count the shader holds in registers (`MAX_TAPS`).
pub const MAX_TAPS: u32 = 8;

/// Mirrors `ConvParams` in conv.wgsl.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct ConvParams {
    pub tokens: u32,
    pub channels: u32,
    pub taps: u32,
    pub _pad0: u32,
    pub src_offset: u32,
    pub src_token_stride: u32,
    pub dst_offset: u32,
    pub dst_token_stride: u32,
}

pub mod reference {
    use super::ConvParams;

    fn silu(x: f64) -> f64 {
        x / (1.0 + (-x).exp())
    }

    /// `weight[c*K + j]`, `state[j*C + c]` (j-th oldest of the last K-1 inputs), updated in place.
    pub fn conv_silu(p: &ConvParams, src: &[f32], weight: &[f32], state: &mut [f32], dst: &mut [f32]) {
        let (k, ch) = (p.taps as usize, p.channels as usize);
        for c in 0..ch {
            let mut window: Vec<f32> = (0..k - 1).map(|j| state[j * ch + c]).collect();
            for t in 0..p.tokens as usize {
                let current = src[p.src_offset as usize + t * p.src_token_stride as usize + c];
                let mut acc = weight[c * k + k - 1] as f64 * current as f64;
                for (j, w) in window.iter().enumerate() {
                    acc += weight[c * k + j] as f64 * *w as f64;
                }
                dst[p.dst_offset as usize + t * p.dst_token_stride as usize + c] = silu(acc) as f32;
                if k > 1 {
                    window.remove(0);
                    window.push(current);
                }
            }
            for (j, w) in window.iter().enumerate() {
                state[j * ch + c] = *w;
            }
        }
    }
}
