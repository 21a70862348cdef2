//! Matrix kernels over resident GGUF weights: mat-vec for decode (1..8 columns per weight read),
//! mat-mat for prefill (f32 register tiles; cooperative-matrix tiles with f16 inputs where the adapter
//! offers them and QK_COOP=1 asks), and the MoE mat-vec whose experts come from ids in a GPU buffer.
//! Activations are f32 columns (one per token) in storage buffers.

use crate::error::{QkError, Result};
use crate::gguf::GgmlType;
use crate::gpu::{Gpu, GpuBuffer, Recorder, ShaderFile, WeightTensor};

pub const MATVEC: ShaderFile = crate::shader_file!("matvec");
pub const MATMUL: ShaderFile = crate::shader_file!("matmul");
pub const MATMUL_COOP: ShaderFile = crate::shader_file!("matmul_coop");

/// Most activation columns one mat-vec dispatch takes (the accumulators live in registers).
pub const MATVEC_MAX_COLS: u32 = 8;

/// f32 columns in a buffer: column j starts at float `offset + j * stride`.
#[derive(Clone, Copy, Debug)]
pub struct Columns<'a> {
    pub buf: &'a GpuBuffer,
    pub offset: u32,
    pub stride: u32,
}

impl<'a> Columns<'a> {
    /// Columns packed back to back, `len` floats each.
    pub fn packed(buf: &'a GpuBuffer, len: u32) -> Self {
        Columns {
            buf,
            offset: 0,
            stride: len,
        }
    }
}

/// The `QTYPE` name the dequant library uses for a ggml type: its `dq8_<name>` function.
pub fn qtype_name(ty: GgmlType) -> &'static str {
    match ty {
        GgmlType::F32 => "f32",
        GgmlType::F16 => "f16",
        GgmlType::BF16 => "bf16",
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q4_1 => "q4_1",
        GgmlType::Q5_0 => "q5_0",
        GgmlType::Q5_1 => "q5_1",
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q2K => "q2_k",
        GgmlType::Q3K => "q3_k",
        GgmlType::Q4K => "q4_k",
        GgmlType::Q5K => "q5_k",
        GgmlType::Q6K => "q6_k",
        GgmlType::IQ1S => "iq1_s",
        GgmlType::IQ1M => "iq1_m",
        GgmlType::IQ2XXS => "iq2_xxs",
        GgmlType::IQ2XS => "iq2_xs",
        GgmlType::IQ2S => "iq2_s",
        GgmlType::IQ3XXS => "iq3_xxs",
        GgmlType::IQ3S => "iq3_s",
        GgmlType::IQ4NL => "iq4_nl",
        GgmlType::IQ4XS => "iq4_xs",
        GgmlType::MXFP4 => "mxfp4",
    }
}

#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct MatvecParams {
    k: u32,
    rows: u32,
    row_bytes: u32,
    w_offset: u32,
    x_offset: u32,
    x_stride: u32,
    y_offset: u32,
    y_stride: u32,
    ids_offset: u32,
    n_used: u32,
    expert_first: u32,
    expert_count: u32,
    x_col_token: u32,
    x_col_slot: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct MatmulParams {
    k: u32,
    rows: u32,
    row_bytes: u32,
    w_offset: u32,
    n: u32,
    x_offset: u32,
    x_stride: u32,
    y_offset: u32,
    y_stride: u32,
}

/// Rows per workgroup and workgroup size of the mat-vec (kernels-perf.md §2.1: ggml uses 1–4 rows
/// per workgroup and one to four subgroups). IQ4_XS defaults to 8 rows × 32 invocations, Q8_0,
/// Q4_K and Q6_K to 4 × 32: best of the shapes swept on the H200 (2026-11-29, 256 MiB, K = 4096,
/// one column: IQ4_XS 1.53 TB/s vs 1.01 at 2 × 64, Q8_0 2.3–2.4 vs 2.2, Q4_K 1.29 vs 1.13, Q6_K
/// 1.49 vs 1.39); the rest keep 2 × 64. `QK_MATVEC_NR` /
/// `QK_MATVEC_WG` override every type for tuning runs (benches/kernels.rs); WG must be a power of
/// two ≥ the subgroup size.
fn matvec_shape(_gpu: &Gpu, ty: GgmlType) -> (u32, u32) {
    static OVERRIDE: std::sync::OnceLock<(Option<u32>, Option<u32>)> = std::sync::OnceLock::new();
    let (nr, wg) = *OVERRIDE.get_or_init(|| {
        let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u32>().ok());
        (env("QK_MATVEC_NR"), env("QK_MATVEC_WG"))
    });
    let (nr_default, wg_default) = match ty {
        GgmlType::IQ4XS => (8, 32),
        GgmlType::Q8_0 | GgmlType::Q4K | GgmlType::Q6K => (4, 32),
        _ => (2, 64),
    };
    (
        nr.unwrap_or(nr_default).clamp(1, 8),
        wg.unwrap_or(wg_default).clamp(8, 1024).next_power_of_two(),
    )
}

/// Steps per loop iteration of the word paths (IQ4_XS, Q8_0, Q4_K): 2 for one or two columns,
/// 1 beyond (their activation registers would crowd out occupancy). `QK_MATVEC_UNROLL` overrides
/// it for tuning runs.
fn matvec_unroll(ncols: u32) -> u32 {
    static OVERRIDE: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    let forced = *OVERRIDE.get_or_init(|| {
        std::env::var("QK_MATVEC_UNROLL")
            .ok()
            .and_then(|v| v.parse::<u32>().ok())
            .map(|u| u.clamp(1, 4))
    });
    forced.unwrap_or(if ncols <= 2 { 2 } else { 1 })
}

fn matvec_pipeline(
    gpu: &Gpu,
    ty: GgmlType,
    ncols: u32,
    moe: bool,
) -> Result<std::sync::Arc<crate::gpu::Pipeline>> {
    let (nr, wg) = matvec_shape(gpu, ty);
    gpu.pipeline(
        &MATVEC,
        &[
            ("QTYPE", qtype_name(ty).into()),
            ("NC", ncols.to_string()),
            ("NR", nr.to_string()),
            ("ACC4", (nr * ncols).div_ceil(4).to_string()),
            ("WG", wg.to_string()),
            ("MOE", u32::from(moe).to_string()),
            ("UNROLL", matvec_unroll(ncols).to_string()),
        ],
        &[],
    )
}

/// Inputs are read as vec4 (offset and stride multiples of 4); outputs are written as f32.
fn check_columns(what: &str, c: &Columns<'_>, len: u64, count: u64, vec4: bool) -> Result<()> {
    if vec4 && (!c.offset.is_multiple_of(4) || !c.stride.is_multiple_of(4)) {
        return Err(QkError::Engine(format!(
            "{what}: offset {} and stride {} must be multiples of 4",
            c.offset, c.stride
        )));
    }
    if count > 0 && c.stride == 0 && count > 1 {
        return Err(QkError::Engine(format!(
            "{what}: zero stride for {count} columns"
        )));
    }
    let end = (u64::from(c.offset) + (count.max(1) - 1) * u64::from(c.stride) + len) * 4;
    if end > c.buf.size {
        return Err(QkError::Engine(format!(
            "{what}: columns end at byte {end}, buffer {} has {}",
            c.buf.label, c.buf.size
        )));
    }
    Ok(())
}

/// A dense product's operands: one matrix (not a stack of experts), `ncols` input columns of K and
/// output columns of its rows inside their buffers. `hint` ends the experts error.
fn check_dense(
    op: &str,
    hint: &str,
    w: &WeightTensor,
    x: &Columns<'_>,
    y: &Columns<'_>,
    ncols: u32,
) -> Result<()> {
    if w.experts != 1 {
        return Err(QkError::Engine(format!(
            "{}: {op} on a stack of {} experts{hint}",
            w.name, w.experts
        )));
    }
    check_columns(&w.name, x, w.cols, u64::from(ncols), true)?;
    check_columns(&w.name, y, w.rows, u64::from(ncols), false)
}

fn as_u32(v: u64, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| QkError::Engine(format!("{what} = {v} exceeds u32")))
}

/// Record y[:, j] = W · x[:, j] for j < ncols (any count; 8 share each weight read). For a dense
/// matrix only (`experts == 1`); the tensor's windows become one dispatch each.
pub fn matvec(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    w: &WeightTensor,
    x: Columns<'_>,
    y: Columns<'_>,
    ncols: u32,
) -> Result<()> {
    check_dense("matvec", "; use matvec_id", w, &x, &y, ncols)?;
    let (nr, _) = matvec_shape(gpu, w.ty);
    let mut done = 0u32;
    while done < ncols {
        let nc = (ncols - done).min(MATVEC_MAX_COLS);
        let pipe = matvec_pipeline(gpu, w.ty, nc, false)?;
        for win in &w.windows {
            let p = MatvecParams {
                k: as_u32(w.cols, "K")?,
                rows: as_u32(win.n_rows, "rows")?,
                row_bytes: as_u32(w.row_bytes, "row bytes")?,
                w_offset: 0,
                x_offset: x.offset + done * x.stride,
                x_stride: x.stride,
                y_offset: y.offset + done * y.stride + as_u32(win.first_row, "row")?,
                y_stride: y.stride,
                ..Default::default()
            };
            let groups = as_u32(win.n_rows.div_ceil(u64::from(nr)), "workgroups")?;
            rec.dispatch(
                &pipe,
                &[win.buffer.all(), x.buf.all(), y.buf.all()],
                bytemuck::bytes_of(&p),
                gpu.grid(groups),
            )?;
        }
        done += nc;
    }
    Ok(())
}

/// Which activation column each (token, slot) of a MoE mat-vec reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeInput {
    /// All slots of token t read column t (gate/up projections of the token's hidden state).
    PerToken,
    /// Slot s of token t reads column t·n_used + s (the down projection of each expert's output).
    PerSlot,
}

/// The experts chosen for each token, in a GPU buffer: `n_used` u32 ids per token for `n_tokens`
/// tokens from u32 index `offset` (written by the router kernel; never read back to the host).
#[derive(Clone, Copy, Debug)]
pub struct ExpertIds<'a> {
    pub buf: &'a GpuBuffer,
    pub offset: u32,
    pub n_used: u32,
    pub n_tokens: u32,
}

/// MoE expert mat-vec: for each token t < n_tokens and slot s < n_used, expert
/// e = ids[offset + t·n_used + s] (read on the GPU) gives y[:, t·n_used + s] = W_e · x[:, …].
/// Multi-token calls re-read each expert per token (a grouped mat-mat is future work).
pub fn matvec_id(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    w: &WeightTensor,
    x: Columns<'_>,
    y: Columns<'_>,
    ids: ExpertIds<'_>,
    input: MoeInput,
) -> Result<()> {
    let ExpertIds {
        buf: ids,
        offset: ids_offset,
        n_used,
        n_tokens,
    } = ids;
    let slots = u64::from(n_used) * u64::from(n_tokens);
    let x_cols = if input == MoeInput::PerSlot {
        slots
    } else {
        u64::from(n_tokens)
    };
    check_columns(&w.name, &x, w.cols, x_cols, true)?;
    check_columns(&w.name, &y, w.rows, slots, false)?;
    if (u64::from(ids_offset) + slots) * 4 > ids.size {
        return Err(QkError::Engine(format!(
            "{}: ids buffer holds fewer than {slots} ids",
            w.name
        )));
    }
    let max = gpu.caps.max_workgroups_per_dim;
    if n_used > max || n_tokens > max {
        return Err(QkError::Engine(format!(
            "{}: {n_used} slots × {n_tokens} tokens exceeds the grid",
            w.name
        )));
    }
    let (nr, _) = matvec_shape(gpu, w.ty);
    let pipe = matvec_pipeline(gpu, w.ty, 1, true)?;
    let (x_col_token, x_col_slot) = match input {
        MoeInput::PerToken => (1, 0),
        MoeInput::PerSlot => (n_used, 1),
    };
    for win in &w.windows {
        if win.first_row % w.rows != 0 || win.n_rows % w.rows != 0 {
            return Err(QkError::Engine(format!(
                "{}: window splits an expert (expert larger than a binding)",
                w.name
            )));
        }
        let p = MatvecParams {
            k: as_u32(w.cols, "K")?,
            rows: as_u32(w.rows, "rows")?,
            row_bytes: as_u32(w.row_bytes, "row bytes")?,
            w_offset: 0,
            x_offset: x.offset,
            x_stride: x.stride,
            y_offset: y.offset,
            y_stride: y.stride,
            ids_offset,
            n_used,
            expert_first: as_u32(win.first_row / w.rows, "expert")?,
            expert_count: as_u32(win.n_rows / w.rows, "experts")?,
            x_col_token,
            x_col_slot,
        };
        let groups = as_u32(w.rows.div_ceil(u64::from(nr)), "workgroups")?;
        rec.dispatch(
            &pipe,
            &[win.buffer.all(), x.buf.all(), y.buf.all(), ids.all()],
            bytemuck::bytes_of(&p),
            [groups, n_used, n_tokens],
        )?;
    }
    Ok(())
}

/// Which mat-mat kernel runs a prefill product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulKernel {
    /// f32 register tiles (matmul.wgsl): every adapter, f32 throughout.
    Tiled,
    /// Cooperative-matrix tiles (matmul_coop.wgsl): f16 inputs, `coop_accumulator` accumulators.
    Coop,
}

/// Fewest activation columns for which the cooperative kernel is chosen: below one 16-wide
/// matrix most of its tile is padding.
pub const COOP_MIN_COLS: u32 = 16;

/// Workgroup memory of matmul_coop.wgsl: two 64×40 f16 tiles and a 64×64 accumulator tile.
const COOP_WG_BYTES: u32 = 2 * 64 * 40 * 2 + 64 * 64 * 4;

/// The accumulator scalar (`"f32"` or `"f16"`) the cooperative mat-mat uses on this device, or
/// None where it cannot run: it needs a 16×16×16 configuration with f16 A/B among the adapter's
/// cooperative-matrix list (f32 accumulation preferred), shader f16, a fixed subgroup size (its
/// workgroup is exactly four subgroups) and room for its tiles.
pub fn coop_accumulator(gpu: &Gpu) -> Option<&'static str> {
    use wgpu::CooperativeScalarType as S;
    let caps = &gpu.caps;
    if !caps.cooperative_matrix
        || !caps.shader_f16
        || caps.subgroup_min_size != caps.subgroup_max_size
        || caps.subgroup_max_size == 0
        || 4 * caps.subgroup_max_size > caps.max_invocations
        || caps.max_workgroup_storage < COOP_WG_BYTES
    {
        return None;
    }
    let offered = |cr: S| {
        caps.cooperative_matrix_configs
            .iter()
            .any(|c| (c.m_size, c.n_size, c.k_size) == (16, 16, 16) && c.ab_type == S::F16 && c.cr_type == cr)
    };
    if offered(S::F32) {
        Some("f32")
    } else if offered(S::F16) {
        Some("f16")
    } else {
        None
    }
}

/// The kernel `matmul` uses for `ncols` columns: the f32 tiled kernel, unless `QK_COOP=1` opts into
/// the cooperative-matrix one (where the adapter offers it and the product is wide enough). Opt-in
/// because its f16 inputs round the activations: on the H200 the engine's prefill logits then miss
/// the float64 reference by NMSE up to 2.7e-2 on the F32 fixture (gate ≤ 1e-6, which the tiled path
/// meets) and unaligned prompt cuts stop agreeing to 1e-9 — for 2.4–4.6× mat-mat speed
/// (benches/RESULTS.md).
pub fn matmul_kernel(gpu: &Gpu, ncols: u32) -> MatmulKernel {
    static COOP: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let coop = *COOP
        .get_or_init(|| std::env::var("QK_COOP").is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true")));
    if coop && ncols >= COOP_MIN_COLS && coop_accumulator(gpu).is_some() {
        MatmulKernel::Coop
    } else {
        MatmulKernel::Tiled
    }
}

/// Mat-mat for prefill: y[:, j] = W · x[:, j] for j < ncols (64×64 output tiles), by the kernel
/// `matmul_kernel` picks.
pub fn matmul(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    w: &WeightTensor,
    x: Columns<'_>,
    y: Columns<'_>,
    ncols: u32,
) -> Result<()> {
    matmul_with(gpu, rec, w, x, y, ncols, matmul_kernel(gpu, ncols))
}

/// `matmul` with an explicit kernel; `Coop` on a device without it is an error.
pub fn matmul_with(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    w: &WeightTensor,
    x: Columns<'_>,
    y: Columns<'_>,
    ncols: u32,
    kernel: MatmulKernel,
) -> Result<()> {
    check_dense("matmul", "", w, &x, &y, ncols)?;
    let pipe = match kernel {
        MatmulKernel::Tiled => gpu.pipeline(&MATMUL, &[("QTYPE", qtype_name(w.ty).into())], &[])?,
        MatmulKernel::Coop => {
            let acc = coop_accumulator(gpu).ok_or_else(|| {
                QkError::Engine(format!(
                    "{}: cooperative mat-mat requested but {} does not offer it",
                    w.name, gpu.adapter.name
                ))
            })?;
            gpu.pipeline(
                &MATMUL_COOP,
                &[
                    ("QTYPE", qtype_name(w.ty).into()),
                    ("SG", gpu.caps.subgroup_max_size.to_string()),
                    ("ACC", acc.into()),
                ],
                &[],
            )?
        }
    };
    let col_tiles = ncols.div_ceil(64);
    if col_tiles > gpu.caps.max_workgroups_per_dim {
        return Err(QkError::Engine(format!(
            "{}: {ncols} columns exceed one dispatch",
            w.name
        )));
    }
    for win in &w.windows {
        let p = MatmulParams {
            k: as_u32(w.cols, "K")?,
            rows: as_u32(win.n_rows, "rows")?,
            row_bytes: as_u32(w.row_bytes, "row bytes")?,
            w_offset: 0,
            n: ncols,
            x_offset: x.offset,
            x_stride: x.stride,
            y_offset: y.offset + as_u32(win.first_row, "row")?,
            y_stride: y.stride,
        };
        let row_tiles = as_u32(win.n_rows.div_ceil(64), "row tiles")?;
        rec.dispatch(
            &pipe,
            &[win.buffer.all(), x.buf.all(), y.buf.all()],
            bytemuck::bytes_of(&p),
            [row_tiles, col_tiles, 1],
        )?;
    }
    Ok(())
}

/// Prefill or decode: the mat-vec for up to 8 columns, the tiled mat-mat beyond.
pub fn mul(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    w: &WeightTensor,
    x: Columns<'_>,
    y: Columns<'_>,
    ncols: u32,
) -> Result<()> {
    if ncols <= MATVEC_MAX_COLS {
        matvec(gpu, rec, w, x, y, ncols)
    } else {
        matmul(gpu, rec, w, x, y, ncols)
    }
}
