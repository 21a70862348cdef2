//! Causal depthwise conv1d + SiLU with its (K-1)-row state (shaders/conv.wgsl), for one token or
//! many (a parallel pass over the tokens and a state pass for long pieces), and its CPU reference.
//! Layouts are documented in the shader.

use super::elementwise::require_len;
use crate::gpu::{Gpu, GpuBuffer, Recorder, ShaderFile};
use crate::{QkError, Result};

pub const FILE: ShaderFile = crate::shader_file!("conv", ConvParams);
/// Invocations per workgroup in conv.wgsl (one invocation per channel).
pub const WORKGROUP: u32 = 64;
/// Tokens from which a call computes its outputs in parallel (one invocation per channel and token,
/// then a state pass) instead of one walk per channel: a 512-token piece's serial walk cost 0.4 ms
/// per layer on an H200 (2026-12-01). Either way every output is the same sum.
pub const PARALLEL_TOKENS: u32 = 16;
/// Largest tap count the shader holds in registers (`MAX_TAPS`).
pub const MAX_TAPS: u32 = 8;

crate::gpu_params! {
    /// The immediates of conv.wgsl.
    pub struct ConvParams {
        pub tokens: u32,
        pub channels: u32,
        pub taps: u32,
        pub src_offset: u32,
        pub src_token_stride: u32,
        pub dst_offset: u32,
        pub dst_token_stride: u32,
        /// Where this sequence's state starts (slots may share one state buffer).
        pub state_offset: u32,
    }
}

/// Record conv + SiLU of `p.tokens` tokens of `src` into `dst`, advancing `state` (decode: 1 token).
pub fn record(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    p: &ConvParams,
    src: &GpuBuffer,
    weight: &GpuBuffer,
    state: &GpuBuffer,
    dst: &GpuBuffer,
) -> Result<()> {
    crate::ensure!(
        (1..=MAX_TAPS).contains(&p.taps),
        QkError::Engine(format!("conv: {} taps (1..={MAX_TAPS})", p.taps))
    );
    let rows = |offset: u32, stride: u32| {
        if p.tokens == 0 {
            0
        } else {
            offset as u64 + (p.tokens as u64 - 1) * stride as u64 + p.channels as u64
        }
    };
    require_len("conv src", src, rows(p.src_offset, p.src_token_stride))?;
    require_len("conv dst", dst, rows(p.dst_offset, p.dst_token_stride))?;
    require_len("conv weight", weight, p.channels as u64 * p.taps as u64)?;
    require_len(
        "conv state",
        state,
        p.state_offset as u64 + p.channels as u64 * (p.taps as u64 - 1),
    )?;
    let bindings = [src.all(), weight.all(), state.all(), dst.all()];
    let groups = p.channels.div_ceil(WORKGROUP);
    if p.tokens < PARALLEL_TOKENS {
        let pipe = gpu.pipeline(&FILE, &[], &[])?;
        return rec.dispatch(&pipe, &bindings, bytemuck::bytes_of(p), gpu.grid(groups));
    }
    crate::ensure!(
        p.tokens <= gpu.caps.max_workgroups_per_dim,
        QkError::Engine(format!("conv: {} tokens exceed the grid", p.tokens))
    );
    let outputs = gpu.pipeline(&FILE, &[("MODE", "outputs".into())], &[])?;
    rec.dispatch(&outputs, &bindings, bytemuck::bytes_of(p), [groups, p.tokens, 1])?;
    let advance = gpu.pipeline(&FILE, &[("MODE", "state".into())], &[])?;
    rec.dispatch(&advance, &bindings, bytemuck::bytes_of(p), gpu.grid(groups))
}

pub mod reference {
    use super::ConvParams;

    fn silu(x: f64) -> f64 {
        x / (1.0 + (-x).exp())
    }

    /// `weight[c*K + j]`, `state[state_offset + j*C + c]` (j-th oldest of the last K-1 inputs), updated in place.
    pub fn conv_silu(p: &ConvParams, src: &[f32], weight: &[f32], state: &mut [f32], dst: &mut [f32]) {
        let (k, ch) = (p.taps as usize, p.channels as usize);
        for c in 0..ch {
            let mut window: Vec<f32> = (0..k - 1)
                .map(|j| state[p.state_offset as usize + j * ch + c])
                .collect();
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
                state[p.state_offset as usize + j * ch + c] = *w;
            }
        }
    }
}
