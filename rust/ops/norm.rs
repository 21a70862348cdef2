//! Row normalisations (shaders/rmsnorm.wgsl): RMSNorm, RMSNorm of x + residual, per-head RMSNorm
//! (q/k of full attention), gated RMSNorm (DeltaNet output) and L2 norm (DeltaNet q/k), with their
//! CPU references.

use super::elementwise::require_len;
use crate::Result;
use crate::gpu::{Gpu, GpuBuffer, Recorder, ShaderFile};

pub const FILE: ShaderFile = crate::shader_file!("rmsnorm", NormParams);

/// Where the rows live: row (token t, head h) starts at `offset + t*token_stride + h*head_stride`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowLayout {
    pub offset: u32,
    pub token_stride: u32,
    pub head_stride: u32,
}

impl RowLayout {
    /// Rows of `n` values packed back to back, `heads` per token.
    pub fn packed(n: u32, heads: u32) -> Self {
        RowLayout {
            offset: 0,
            token_stride: n * heads,
            head_stride: n,
        }
    }

    fn start(&self, t: usize, h: usize) -> usize {
        self.offset as usize + t * self.token_stride as usize + h * self.head_stride as usize
    }

    /// Elements a buffer needs to hold `tokens x heads` rows of `n`.
    pub fn extent(&self, tokens: u32, heads: u32, n: u32) -> u64 {
        if tokens == 0 || heads == 0 {
            return 0;
        }
        self.start(tokens as usize - 1, heads as usize - 1) as u64 + n as u64
    }
}

crate::gpu_params! {
    /// The immediates of rmsnorm.wgsl.
    pub struct NormParams {
        pub tokens: u32,
        pub heads: u32,
        pub n: u32,
        pub src_offset: u32,
        pub src_token_stride: u32,
        pub src_head_stride: u32,
        pub dst_offset: u32,
        pub dst_token_stride: u32,
        pub dst_head_stride: u32,
        pub eps: f32,
        pub scale: f32,
    }
}

impl NormParams {
    pub fn new(
        tokens: u32,
        heads: u32,
        n: u32,
        src: RowLayout,
        dst: RowLayout,
        eps: f32,
        scale: f32,
    ) -> Self {
        NormParams {
            tokens,
            heads,
            n,
            src_offset: src.offset,
            src_token_stride: src.token_stride,
            src_head_stride: src.head_stride,
            dst_offset: dst.offset,
            dst_token_stride: dst.token_stride,
            dst_head_stride: dst.head_stride,
            eps,
            scale,
        }
    }

    pub fn rows(&self) -> u32 {
        self.tokens * self.heads
    }

    pub fn src(&self) -> RowLayout {
        RowLayout {
            offset: self.src_offset,
            token_stride: self.src_token_stride,
            head_stride: self.src_head_stride,
        }
    }

    pub fn dst(&self) -> RowLayout {
        RowLayout {
            offset: self.dst_offset,
            token_stride: self.dst_token_stride,
            head_stride: self.dst_head_stride,
        }
    }
}

/// The entry points of rmsnorm.wgsl.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NormKind {
    /// dst = x / rms(x) * w * scale
    Rms,
    /// sum = x + r; dst = rms_norm(sum)
    RmsResidual,
    /// x = x + r (in place); dst = rms_norm(x)
    RmsResidualInPlace,
    /// dst = rms_norm(x) * SiLU(z)
    RmsGated,
    /// dst = x / max(|x|, eps) * scale (no weight)
    L2,
}

impl NormKind {
    /// The shader's `OP` variant.
    pub fn variant(self) -> &'static str {
        match self {
            NormKind::Rms => "rms",
            NormKind::RmsResidual => "residual",
            NormKind::RmsResidualInPlace => "residual_inplace",
            NormKind::RmsGated => "gated",
            NormKind::L2 => "l2",
        }
    }
}

/// The operands of one normalisation; which are needed depends on the kind.
pub struct NormArgs<'a> {
    pub src: &'a GpuBuffer,
    pub dst: &'a GpuBuffer,
    /// Length n, shared by all heads (not for `L2`).
    pub weight: Option<&'a GpuBuffer>,
    /// `RmsResidual*`: the residual; `RmsGated`: the gate z. Laid out like `src`.
    pub other: Option<&'a GpuBuffer>,
    /// `RmsResidual`: receives src + residual, laid out like `src`.
    pub sum: Option<&'a GpuBuffer>,
}

fn operand<'a>(kind: NormKind, what: &str, b: Option<&'a GpuBuffer>) -> Result<&'a GpuBuffer> {
    b.ok_or_else(|| crate::QkError::Engine(format!("{kind:?} norm needs a {what} buffer")))
}

/// Record one normalisation dispatch (one workgroup per row).
pub fn record(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    kind: NormKind,
    p: &NormParams,
    args: &NormArgs<'_>,
) -> Result<()> {
    let op = "norm";
    require_len(op, args.src, p.src().extent(p.tokens, p.heads, p.n))?;
    require_len(op, args.dst, p.dst().extent(p.tokens, p.heads, p.n))?;
    let pipe = gpu.pipeline(&FILE, &[("OP", kind.variant().to_string())], &[])?;
    let mut bindings = vec![args.src.all()];
    if kind != NormKind::L2 {
        let w = operand(kind, "weight", args.weight)?;
        require_len(op, w, p.n as u64)?;
        bindings.push(w.all());
    }
    bindings.push(args.dst.all());
    if matches!(
        kind,
        NormKind::RmsResidual | NormKind::RmsResidualInPlace | NormKind::RmsGated
    ) {
        let other = operand(kind, "residual/gate", args.other)?;
        require_len(op, other, p.src().extent(p.tokens, p.heads, p.n))?;
        bindings.push(other.all());
    }
    if kind == NormKind::RmsResidual {
        let sum = operand(kind, "sum", args.sum)?;
        require_len(op, sum, p.src().extent(p.tokens, p.heads, p.n))?;
        bindings.push(sum.all());
    }
    rec.dispatch(&pipe, &bindings, bytemuck::bytes_of(p), gpu.grid(p.rows()))
}

/// Plain-Rust versions of the kernels, in f64 accumulation, for tests.
pub mod reference {
    use super::{NormKind, NormParams};

    fn silu(x: f64) -> f64 {
        x / (1.0 + (-x).exp())
    }

    /// Runs `kind` over `src` into `dst` (and `sum_out` for `RmsResidual*`: the new x of the
    /// in-place form). `other` is the residual or the gate z, laid out like `src`.
    pub fn norm(
        kind: NormKind,
        p: &NormParams,
        src: &[f32],
        weight: &[f32],
        other: &[f32],
        dst: &mut [f32],
        sum_out: &mut [f32],
    ) {
        let n = p.n as usize;
        for t in 0..p.tokens as usize {
            for h in 0..p.heads as usize {
                let s = p.src().start(t, h);
                let d = p.dst().start(t, h);
                let row: Vec<f64> = (0..n)
                    .map(|i| match kind {
                        NormKind::RmsResidual | NormKind::RmsResidualInPlace => {
                            src[s + i] as f64 + other[s + i] as f64
                        }
                        _ => src[s + i] as f64,
                    })
                    .collect();
                if matches!(kind, NormKind::RmsResidual | NormKind::RmsResidualInPlace) {
                    for i in 0..n {
                        sum_out[s + i] = src[s + i] + other[s + i];
                    }
                }
                let sq: f64 = row.iter().map(|v| v * v).sum();
                let inv = match kind {
                    NormKind::L2 => p.scale as f64 / sq.sqrt().max(p.eps as f64),
                    _ => p.scale as f64 / (sq / n as f64 + p.eps as f64).sqrt(),
                };
                for i in 0..n {
                    let v = row[i] * inv;
                    dst[d + i] = match kind {
                        NormKind::L2 => v,
                        NormKind::RmsGated => v * weight[i] as f64 * silu(other[s + i] as f64),
                        _ => v * weight[i] as f64,
                    } as f32;
                }
            }
        }
    }
}
