//! The runtime's example op (`shaders/common_scale.wgsl`): y = a·x + b plus per-workgroup sums.
//! Small on purpose: it shows the pattern every op follows and is what the runtime tests drive.

use super::{Gpu, GpuBuffer, Recorder, ShaderFile};
use crate::error::{QkError, Result};

pub const SCALE: ShaderFile = crate::shader_file!("common_scale", ScaleParams);

/// Workgroup size of the kernel (its partial sums cover this many elements each).
pub const SCALE_WG: u32 = 64;

crate::gpu_params! {
    /// The kernel's immediates: element count and the affine map.
    pub struct ScaleParams {
        pub n: u32,
        pub a: f32,
        pub b: f32,
    }
}

/// Record `y[i] = a*x[i] + b` for i < n and `partial[g] = Σ y` over each group of SCALE_WG.
pub fn scale_add(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    x: &GpuBuffer,
    y: &GpuBuffer,
    partial: &GpuBuffer,
    params: ScaleParams,
) -> Result<()> {
    let n = params.n;
    let groups = n.div_ceil(SCALE_WG);
    if u64::from(n) * 4 > x.size.min(y.size) || u64::from(groups) * 4 > partial.size {
        return Err(QkError::Engine(format!("scale_add: buffers too small for n={n}")));
    }
    let pipe = gpu.pipeline(&SCALE, &[("WG", SCALE_WG.to_string())], &[])?;
    rec.dispatch(
        &pipe,
        &[x.all(), y.all(), partial.all()],
        bytemuck::bytes_of(&params),
        gpu.grid(groups),
    )
}

pub const COPY: ShaderFile = crate::shader_file!("common_copy", CopyParams);
const COPY_WG: u32 = 256;

crate::gpu_params! {
    struct CopyParams {
        /// vec4<u32> elements to copy, and the stride of the grid in elements.
        n: u32,
        stride: u32,
    }
}

/// Record a copy of the first `bytes` (a multiple of 16) of `src` to `dst` as a compute dispatch
/// (stays inside the current compute pass, unlike `Recorder::copy`).
pub fn copy_kernel(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    src: &GpuBuffer,
    dst: &GpuBuffer,
    bytes: u64,
) -> Result<()> {
    if !bytes.is_multiple_of(16) || bytes > src.size.min(dst.size) {
        return Err(QkError::Engine(format!(
            "copy_kernel: {bytes} bytes is not a multiple of 16 or too large"
        )));
    }
    let n = u32::try_from(bytes / 16).map_err(|_| QkError::Engine("copy_kernel: too large".into()))?;
    // Enough workgroups to fill any GPU (a few per SM on the largest), each looping grid-stride.
    let groups = n.div_ceil(COPY_WG).clamp(1, 4096);
    let pipe = gpu.pipeline(&COPY, &[("WG", COPY_WG.to_string())], &[])?;
    let p = CopyParams {
        n,
        stride: groups * COPY_WG,
    };
    rec.dispatch(
        &pipe,
        &[src.range(0, bytes), dst.range(0, bytes)],
        bytemuck::bytes_of(&p),
        [groups, 1, 1],
    )
}
