//! Small fused element-wise ops (shaders/elementwise.wgsl): SiLU(gate)*up, add, sigmoid gating, row
//! copy and the MoE combine; and their CPU references.

use bytemuck::{Pod, Zeroable};

pub const SHADER_NAME: &str = "elementwise";
pub const SHADER_SOURCE: &str = include_str!("../../shaders/elementwise.wgsl");
/// Invocations per workgroup (one per element).
pub const WORKGROUP: u32 = 64;

/// The entry points of elementwise.wgsl.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EwKind {
    /// out = SiLU(a) * b
    SiluMul,
    /// out = a + b
    Add,
    /// out = a * sigmoid(b)
    MulSigmoid,
    /// out = a
    CopyRows,
    /// out (+)= sum_e weights_e * a_e + sigmoid(gate) * b
    MoeCombine,
}

impl EwKind {
    pub fn entry_point(self) -> &'static str {
        match self {
            EwKind::SiluMul => "silu_mul",
            EwKind::Add => "add",
            EwKind::MulSigmoid => "mul_sigmoid",
            EwKind::CopyRows => "copy_rows",
            EwKind::MoeCombine => "moe_combine",
        }
    }
}

/// Mirrors `EwParams` in elementwise.wgsl; operand X of row r, element i at x_offset + r*x_stride + i.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct EwParams {
    pub rows: u32,
    pub n: u32,
    pub a_offset: u32,
    pub a_stride: u32,
    pub b_offset: u32,
    pub b_stride: u32,
    pub out_offset: u32,
    pub out_stride: u32,
    pub weights_offset: u32,
    pub weights_stride: u32,
    pub experts: u32,
    pub accumulate: u32,
    pub gate_offset: u32,
    pub gate_stride: u32,
    pub _pad0: u32,
    pub _pad1: u32,
}

impl EwParams {
    /// Every operand packed as rows of n.
    pub fn packed(rows: u32, n: u32) -> Self {
        EwParams {
            rows,
            n,
            a_stride: n,
            b_stride: n,
            out_stride: n,
            ..Default::default()
        }
    }

    pub fn elements(&self) -> u32 {
        self.rows * self.n
    }
}

pub mod reference {
    use super::{EwKind, EwParams};

    fn sigmoid(x: f64) -> f64 {
        1.0 / (1.0 + (-x).exp())
    }

    pub fn run(
        kind: EwKind,
        p: &EwParams,
        a: &[f32],
        b: &[f32],
        weights: &[f32],
        gate: &[f32],
        out: &mut [f32],
    ) {
        for r in 0..p.rows as usize {
            for i in 0..p.n as usize {
                let av = |off: usize| a[p.a_offset as usize + r * p.a_stride as usize + off + i] as f64;
                let bv = b
                    .get(p.b_offset as usize + r * p.b_stride as usize + i)
                    .map(|x| *x as f64);
                let o = p.out_offset as usize + r * p.out_stride as usize + i;
                out[o] = match kind {
                    EwKind::SiluMul => av(0) * sigmoid(av(0)) * bv.unwrap_or(0.0),
                    EwKind::Add => av(0) + bv.unwrap_or(0.0),
                    EwKind::MulSigmoid => av(0) * sigmoid(bv.unwrap_or(0.0)),
                    EwKind::CopyRows => av(0),
                    EwKind::MoeCombine => {
                        let mut acc: f64 = (0..p.experts as usize)
                            .map(|e| {
                                weights[p.weights_offset as usize + r * p.weights_stride as usize + e] as f64
                                    * av(e * p.n as usize)
                            })
                            .sum();
                        acc += sigmoid(gate[p.gate_offset as usize + r * p.gate_stride as usize] as f64)
                            * bv.unwrap_or(0.0);
                        if p.accumulate != 0 {
                            acc += out[o] as f64;
                        }
                        acc
                    }
                } as f32;
            }
        }
    }
}
