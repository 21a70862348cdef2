//! Small fused element-wise ops (shaders/elementwise.wgsl): SiLU(gate)*up, add, sigmoid gating, row
//! copy and the MoE combine; and their CPU references.

use crate::gpu::{Gpu, GpuBuffer, Recorder, ShaderFile};
use crate::{QkError, Result};

pub const FILE: ShaderFile = crate::shader_file!("elementwise", EwParams);
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
    /// out (+)= sum_e weights_e * a_e (the shared expert, if any, is one of the e)
    MoeSum,
}

impl EwKind {
    /// The shader's `OP` variant.
    pub fn variant(self) -> &'static str {
        match self {
            EwKind::SiluMul => "silu_mul",
            EwKind::Add => "add",
            EwKind::MulSigmoid => "mul_sigmoid",
            EwKind::CopyRows => "copy",
            EwKind::MoeCombine => "moe_combine",
            EwKind::MoeSum => "moe_sum",
        }
    }
}

/// Fails unless `buf` holds at least `elements` 4-byte values (kernels index by element offsets
/// in their parameters; this turns a wrong shape into an error instead of a clamped read).
pub fn require_len(op: &str, buf: &GpuBuffer, elements: u64) -> Result<()> {
    crate::ensure!(
        buf.size >= elements * 4,
        QkError::Engine(format!(
            "{op}: buffer {} holds {} bytes, needs {}",
            buf.label,
            buf.size,
            elements * 4
        ))
    );
    Ok(())
}

fn rows_extent(rows: u32, offset: u32, stride: u32, n: u32) -> u64 {
    if rows == 0 {
        0
    } else {
        offset as u64 + (rows as u64 - 1) * stride as u64 + n as u64
    }
}

/// The operands of an element-wise op; `b` is unused by `CopyRows`, `weights`/`gate` only by
/// `MoeCombine` (where `a` holds `experts` outputs of n per row and `b` the shared expert's).
pub struct EwArgs<'a> {
    pub a: &'a GpuBuffer,
    pub b: Option<&'a GpuBuffer>,
    pub out: &'a GpuBuffer,
    pub weights: Option<&'a GpuBuffer>,
    pub gate: Option<&'a GpuBuffer>,
}

/// Record one element-wise dispatch (one invocation per output element).
pub fn record(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    kind: EwKind,
    p: &EwParams,
    args: &EwArgs<'_>,
) -> Result<()> {
    let op = kind.variant();
    let missing = |what: &str| QkError::Engine(format!("{op}: needs a {what} buffer"));
    let experts_in_a = matches!(kind, EwKind::MoeCombine | EwKind::MoeSum);
    let a_width = if experts_in_a { p.n * p.experts } else { p.n };
    require_len(op, args.a, rows_extent(p.rows, p.a_offset, p.a_stride, a_width))?;
    require_len(op, args.out, rows_extent(p.rows, p.out_offset, p.out_stride, p.n))?;
    let pipe = gpu.pipeline(&FILE, &[("OP", op.to_string())], &[])?;
    let mut bindings = vec![args.a.all()];
    if !matches!(kind, EwKind::CopyRows | EwKind::MoeSum) {
        let b = args.b.ok_or_else(|| missing("b"))?;
        require_len(op, b, rows_extent(p.rows, p.b_offset, p.b_stride, p.n))?;
        bindings.push(b.all());
    }
    bindings.push(args.out.all());
    if experts_in_a {
        let w = args.weights.ok_or_else(|| missing("weights"))?;
        require_len(
            op,
            w,
            rows_extent(p.rows, p.weights_offset, p.weights_stride, p.experts),
        )?;
        bindings.push(w.all());
    }
    if kind == EwKind::MoeCombine {
        let g = args.gate.ok_or_else(|| missing("gate"))?;
        require_len(op, g, rows_extent(p.rows, p.gate_offset, p.gate_stride, 1))?;
        bindings.push(g.all());
    }
    rec.dispatch(
        &pipe,
        &bindings,
        bytemuck::bytes_of(p),
        gpu.grid(p.elements().div_ceil(WORKGROUP)),
    )
}

crate::gpu_params! {
    /// The immediates of elementwise.wgsl; operand X of row r, element i at x_offset + r*x_stride + i.
    pub struct EwParams {
        pub rows: u32,
        pub n: u32,
        pub a_offset: u32,
        pub a_stride: u32,
        pub b_offset: u32,
        pub b_stride: u32,
        pub out_offset: u32,
        pub out_stride: u32,
        /// moe_combine: expert weights of row r at weights_offset + r * weights_stride + e.
        pub weights_offset: u32,
        pub weights_stride: u32,
        /// moe_combine: experts per row; expert e's output starts at e * n within a row of a.
        pub experts: u32,
        /// moe_combine: 1 adds the result to out instead of overwriting it.
        pub accumulate: u32,
        /// moe_combine: shared-expert gate logit of row r at gate_offset + r * gate_stride.
        pub gate_offset: u32,
        pub gate_stride: u32,
    }
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
                    EwKind::MoeCombine | EwKind::MoeSum => {
                        let mut acc: f64 = (0..p.experts as usize)
                            .map(|e| {
                                weights[p.weights_offset as usize + r * p.weights_stride as usize + e] as f64
                                    * av(e * p.n as usize)
                            })
                            .sum();
                        if kind == EwKind::MoeCombine {
                            acc += sigmoid(gate[p.gate_offset as usize + r * p.gate_stride as usize] as f64)
                                * bv.unwrap_or(0.0);
                        }
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
