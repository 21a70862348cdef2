//! One decode position of a gated DeltaNet layer for every row of a step (shaders/gdn_step.wgsl):
//! delta rule and output gate in one dispatch, each row on its own slot's state, a head's columns
//! spread over several workgroups; the gated norm's per-head RMS is finished by the output
//! projection (`MatvecInput::HeadRms`) from the sums of squares this step writes.

use super::elementwise::require_len;
use crate::error::{QkError, Result};
use crate::gpu::{Gpu, GpuBuffer, Recorder, ShaderFile};

pub const FILE: ShaderFile = crate::shader_file!("gdn_step", GdnStepParams);
/// How the step spreads a head's value columns: invocations per workgroup at most, and columns per
/// invocation (gdn_step.wgsl `CPC`). Many workgroups per head: one per head left most of an H200
/// idle (18 µs per one-row step). [`record`] takes [`GdnStepShape::for_rows`]; tuning runs pass
/// others to [`record_shaped`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdnStepShape {
    pub max_wg: u32,
    pub columns: u32,
}

impl GdnStepShape {
    /// One row: 8 columns of 32 lanes per workgroup, one column per invocation.
    pub const ONE_ROW: GdnStepShape = GdnStepShape {
        max_wg: 256,
        columns: 1,
    };
    /// Several rows: the same 8 columns per workgroup, two per invocation (half the invocations),
    /// so each keeps twice the state loads in flight. Kernel bench `gdn_step` (H200, 2026-12-02,
    /// states cold): 8 rows 24.8 → 19.6 µs, one row 7.3 either way; in the engine (same lease) the
    /// 8-slot step's `dn.step` 1,032 → 871 µs but the one-slot one 411 → 461, hence a shape per
    /// case. Both have the same columns per workgroup, so the same parts and the same bytes.
    pub const ROWS: GdnStepShape = GdnStepShape {
        max_wg: 128,
        columns: 2,
    };

    /// The shape [`record`] uses for a step of `rows` rows.
    pub fn for_rows(rows: u32) -> GdnStepShape {
        if rows > 1 { Self::ROWS } else { Self::ONE_ROW }
    }

    /// Workgroups per head of `dv` columns on this device at this shape.
    pub fn parts(self, gpu: &Gpu, dv: u32) -> u32 {
        dv.div_ceil(self.columns_per_workgroup(gpu))
    }

    fn columns_per_workgroup(self, gpu: &Gpu) -> u32 {
        workgroup(gpu, self.max_wg) / lanes(gpu) * self.columns_on(gpu)
    }

    /// Columns per invocation on this device: one without subgroups, where an invocation already
    /// holds a whole column (MAX_DK floats).
    fn columns_on(self, gpu: &Gpu) -> u32 {
        if lanes(gpu) == 1 { 1 } else { self.columns }
    }

    /// This shape on this device: [`GdnStepShape::ONE_ROW`] where the device's workgroup limit would
    /// give it other columns per workgroup than that one (a row's sums must group the same columns
    /// in every batch).
    fn on(self, gpu: &Gpu) -> GdnStepShape {
        if self.columns_per_workgroup(gpu) != Self::ONE_ROW.columns_per_workgroup(gpu) {
            Self::ONE_ROW
        } else {
            self
        }
    }
}

/// Largest key and value head dims one workgroup holds.
pub const MAX_DK: u32 = 128;
pub const MAX_DV: u32 = 128;

/// Invocations sharing a value column (gdn_step.wgsl `LANES`): the subgroup size where subgroups
/// have one fixed size (the column's sums are subgroup sums), else 1.
fn lanes(gpu: &Gpu) -> u32 {
    let c = &gpu.caps;
    let sg = c.subgroup_max_size;
    if c.subgroups && sg == c.subgroup_min_size && sg.is_power_of_two() && (2..=64).contains(&sg) {
        sg
    } else {
        1
    }
}

fn prev_power_of_two(n: u32) -> u32 {
    if n == 0 { 1 } else { 1 << (31 - n.leading_zeros()) }
}

crate::gpu_params! {
    /// The immediates of gdn_step.wgsl.
    pub struct GdnStepParams {
        pub rows: u32,
        pub k_heads: u32,
        pub v_heads: u32,
        pub dk: u32,
        pub dv: u32,
        /// 0: k-head of v-head n is n / (v_heads / k_heads) (qwen3next); 1: n % k_heads (qwen35*).
        pub pairing: u32,
        pub qkv_offset: u32,
        pub qkv_stride: u32,
        pub q_offset: u32,
        pub k_offset: u32,
        pub v_offset: u32,
        pub ba_offset: u32,
        pub ba_stride: u32,
        /// beta of v-head n at ba_offset + r · ba_stride + beta_offset + (n / ba_group) · ba_group_stride
        /// + n % ba_group; alpha likewise at alpha_offset.
        pub ba_group: u32,
        pub ba_group_stride: u32,
        pub beta_offset: u32,
        pub alpha_offset: u32,
        pub z_offset: u32,
        pub z_stride: u32,
        pub out_offset: u32,
        pub out_stride: u32,
        pub state_stride: u32,
        pub slots_offset: u32,
        /// Workgroups per head; set by [`record`] (any value passed is replaced).
        /// Workgroups per head (ceil(dv / COLS)), and where the sums of o² go (see above).
        pub parts: u32,
        /// Row r's sums of o², one per (head, part), at `sq[sq_offset + r · sq_stride ..]`.
        pub sq_offset: u32,
        pub sq_stride: u32,
        pub eps: f32,
        pub q_scale: f32,
    }
}

/// The buffers of a step.
pub struct GdnStepArgs<'a> {
    /// Conv output (q ‖ k ‖ v) of each row.
    pub qkv: &'a GpuBuffer,
    pub ba: &'a GpuBuffer,
    pub ssm_a: &'a GpuBuffer,
    pub dt_bias: &'a GpuBuffer,
    /// The output gate z of each row.
    pub z: &'a GpuBuffer,
    /// The gated norm's weight (dv floats).
    pub norm: &'a GpuBuffer,
    /// Where the sums of o² go (see [`GdnStepParams::sq_offset`]).
    pub sq: &'a GpuBuffer,
    /// Row r's slot at `slots[slots_offset + r]`.
    pub slots: &'a GpuBuffer,
    /// Every slot's S (slot s at float s · state_stride).
    pub state: &'a GpuBuffer,
    pub out: &'a GpuBuffer,
}

fn extent(rows: u32, offset: u32, stride: u32, width: u32) -> u64 {
    u64::from(offset) + u64::from(rows.saturating_sub(1)) * u64::from(stride) + u64::from(width)
}

/// Workgroups per head of `dv` columns on this device (the `parts` of [`GdnStepParams`]): the
/// output projection's norm sums that many partial sums per head, whatever the step's rows.
pub fn parts(gpu: &Gpu, dv: u32) -> u32 {
    GdnStepShape::ONE_ROW.parts(gpu, dv)
}

fn workgroup(gpu: &Gpu, max_wg: u32) -> u32 {
    let lanes = lanes(gpu);
    prev_power_of_two(max_wg.min(gpu.caps.max_invocations).min(MAX_DV * lanes)).max(lanes)
}

/// Record the step for `p.rows` rows (grid: v_heads · parts × rows).
pub fn record(gpu: &Gpu, rec: &mut Recorder<'_>, p: &GdnStepParams, a: &GdnStepArgs<'_>) -> Result<()> {
    record_shaped(gpu, rec, p, a, GdnStepShape::for_rows(p.rows).on(gpu))
}

/// [`record`] with another spread of the columns (tuning runs; the output projection's `parts`
/// must then be those of the same shape, which only [`record`] keeps).
pub fn record_shaped(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    p: &GdnStepParams,
    a: &GdnStepArgs<'_>,
    shape: GdnStepShape,
) -> Result<()> {
    crate::ensure!(
        (1..=8).contains(&shape.columns),
        QkError::Engine(format!("gdn step: {} columns per invocation", shape.columns))
    );
    crate::ensure!(
        p.dk >= 1
            && p.dk <= MAX_DK
            && p.dv >= 1
            && p.dv <= MAX_DV
            && p.k_heads >= 1
            && p.v_heads.is_multiple_of(p.k_heads)
            && p.ba_group >= 1,
        QkError::Engine(format!(
            "gdn step: dk {} dv {} with {} k-heads, {} v-heads (at most {MAX_DK} and {MAX_DV})",
            p.dk, p.dv, p.k_heads, p.v_heads
        ))
    );
    if p.rows == 0 {
        return Ok(());
    }
    let vd = p.v_heads * p.dv;
    let qkv_width = (p.q_offset.max(p.k_offset) + p.k_heads * p.dk).max(p.v_offset + vd);
    require_len(
        "gdn step qkv",
        a.qkv,
        extent(p.rows, p.qkv_offset, p.qkv_stride, qkv_width),
    )?;
    let last = p.v_heads - 1;
    let ba_width =
        p.beta_offset.max(p.alpha_offset) + (last / p.ba_group) * p.ba_group_stride + last % p.ba_group + 1;
    require_len(
        "gdn step ba",
        a.ba,
        extent(p.rows, p.ba_offset, p.ba_stride, ba_width),
    )?;
    require_len("gdn step ssm_a", a.ssm_a, u64::from(p.v_heads))?;
    require_len("gdn step dt_bias", a.dt_bias, u64::from(p.v_heads))?;
    require_len("gdn step z", a.z, extent(p.rows, p.z_offset, p.z_stride, vd))?;
    require_len("gdn step norm", a.norm, u64::from(p.dv))?;
    require_len(
        "gdn step slots",
        a.slots,
        u64::from(p.slots_offset) + u64::from(p.rows),
    )?;
    require_len(
        "gdn step out",
        a.out,
        extent(p.rows, p.out_offset, p.out_stride, vd),
    )?;
    crate::ensure!(
        u64::from(p.state_stride) >= u64::from(vd) * u64::from(p.dk),
        QkError::Engine("gdn step: state stride smaller than one slot's S".into())
    );
    require_len("gdn step state", a.state, u64::from(p.state_stride))?;
    let parts = shape.parts(gpu, p.dv);
    crate::ensure!(
        p.sq_stride >= p.v_heads * parts,
        QkError::Engine(format!(
            "gdn step: {} sums of squares per row, stride {}",
            p.v_heads * parts,
            p.sq_stride
        ))
    );
    require_len(
        "gdn step sums of squares",
        a.sq,
        extent(p.rows, p.sq_offset, p.sq_stride, p.v_heads * parts),
    )?;
    let p = GdnStepParams { parts, ..*p };
    let lanes = lanes(gpu);
    let pipe = gpu.pipeline(
        &FILE,
        &[
            ("WG", workgroup(gpu, shape.max_wg).to_string()),
            ("LANES", lanes.to_string()),
            ("ROWS", (MAX_DK / lanes).to_string()),
            ("CPC", shape.columns_on(gpu).to_string()),
        ],
        &[],
    )?;
    rec.dispatch(
        &pipe,
        &[
            a.qkv.all(),
            a.ba.all(),
            a.ssm_a.all(),
            a.dt_bias.all(),
            a.z.all(),
            a.norm.all(),
            a.slots.all(),
            a.state.all(),
            a.out.all(),
            a.sq.all(),
        ],
        bytemuck::bytes_of(&p),
        [p.v_heads * parts, p.rows, 1],
    )
}
