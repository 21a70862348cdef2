//! Matrix kernels over resident GGUF weights: mat-vec for decode (1..8 columns per weight read),
//! mat-mat for prefill (cooperative-matrix tiles with f16 inputs where the adapter offers them and
//! the engine is not `Precision::Precise`, f32 register tiles otherwise), the MoE mat-vec whose
//! experts come from ids in a GPU buffer, and for prefill the grouped MoE mat-mat: the batch's
//! (token, slot) entries sorted by expert on the GPU, then one dispatch for all routed experts.
//! Activations are f32 columns (one per token) in storage buffers.

use super::elementwise::require_len;
use crate::error::{QkError, Result};
use crate::gguf::GgmlType;
use crate::gpu::{Binding, Gpu, GpuBuffer, Recorder, ShaderFile, WeightTensor};

pub const MATVEC: ShaderFile = crate::shader_file!("matvec", MatvecParams);
pub const MATMUL: ShaderFile = crate::shader_file!("matmul", MatmulParams);
pub const MATMUL_COOP: ShaderFile = crate::shader_file!("matmul_coop", MatmulParams);
pub const MOE_GROUP: ShaderFile = crate::shader_file!("moe_group", GroupParams);
pub const MATMUL_REDUCE: ShaderFile = crate::shader_file!("matmul_reduce", ReduceParams);

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

crate::gpu_params! {
    struct MatvecParams {
        /// Weights per row, rows to compute (per expert with MOE), bytes per row.
        k: u32,
        rows: u32,
        row_bytes: u32,
        /// Byte offset in W of this window's first row.
        w_offset: u32,
        /// Float index of X column 0 and floats between columns (both multiples of 4).
        x_offset: u32,
        x_stride: u32,
        /// Float index of Y row 0 of column 0, and floats between output columns.
        y_offset: u32,
        y_stride: u32,
        /// MOE: index of the first id in IDS, ids per token (n_used), experts held by this window.
        ids_offset: u32,
        n_used: u32,
        expert_first: u32,
        expert_count: u32,
        /// MOE: X column = token * x_col_token + slot * x_col_slot.
        x_col_token: u32,
        x_col_slot: u32,
        /// PRE=rms: the norm's epsilon. PRE=silu_mul: floats from a column's gate to its up.
        eps: f32,
        pre_offset: u32,
        /// EPI=conv: conv channels (the first rows), taps, floats of conv state per slot, and the index
        /// of column 0's slot in SLOTS.
        conv_rows: u32,
        taps: u32,
        state_stride: u32,
        slots_offset: u32,
        /// ROUTE: token t's logits at route_logits + t * route_stride, experts of them, and (route_shared)
        /// the shared expert as pick n_used - 1 (id route_experts, gate logit after the experts').
        route_logits: u32,
        route_stride: u32,
        route_experts: u32,
        route_shared: u32,
        /// PRE=head_rms: partial sums per head, column 0's first sum, floats between columns' sums.
        head_parts: u32,
        sq_offset: u32,
        sq_stride: u32,
        /// EXTRA: W2's rows and the vec4 index of its first.
        extra_rows: u32,
        extra_offset: u32,
    }
}

/// What a mat-vec does to its activation columns before the product (matvec.wgsl `PRE`).
#[derive(Clone, Copy, Debug, Default)]
pub enum MatvecInput<'a> {
    #[default]
    Plain,
    /// RMSNorm each column with `weight` (K floats) and `eps` first; with `store`, also write the
    /// normalised columns there (packed, K floats each) for later kernels.
    Rms {
        weight: &'a GpuBuffer,
        eps: f32,
        store: Option<&'a GpuBuffer>,
    },
    /// Each column is a gate ‖ up pair with `up` floats from gate to up; the input is
    /// silu(gate) · up (K = the pair's half).
    SiluMul { up: u32 },
    /// Each column is `heads` heads of `head_dim` floats (K = heads · head_dim, head_dim a
    /// multiple of 4), head h of column c scaled by 1/sqrt(S / head_dim + eps), S the sum over
    /// g < `parts` of sums[offset + c · stride + h · parts + g]: the RMS norm of each head,
    /// finished from sums of squares an earlier kernel wrote (the gated DeltaNet step's).
    HeadRms {
        sums: &'a GpuBuffer,
        heads: u32,
        head_dim: u32,
        parts: u32,
        offset: u32,
        stride: u32,
        eps: f32,
    },
}

/// Where a mat-vec's results go (matvec.wgsl `EPI`).
#[derive(Clone, Copy, Debug, Default)]
pub enum MatvecOutput<'a> {
    #[default]
    Store,
    /// y = residual + W·x, `residual` laid out like y.
    AddTo { residual: &'a GpuBuffer },
    /// The first `channels` rows are GDN conv inputs: conv1d (`taps` taps, `weights`
    /// [channel × taps]) + SiLU, advancing each column's slot state in `state` (slot s at float
    /// s · `state_stride`, layout of shaders/conv.wgsl); column c's slot is `slots[slots_offset + c]`.
    Conv {
        weights: &'a GpuBuffer,
        state: &'a GpuBuffer,
        slots: &'a GpuBuffer,
        slots_offset: u32,
        channels: u32,
        taps: u32,
        state_stride: u32,
    },
}

/// The fused stages of one mat-vec dispatch.
#[derive(Clone, Copy, Debug, Default)]
pub struct MatvecFusion<'a> {
    pub input: MatvecInput<'a>,
    pub output: MatvecOutput<'a>,
}

impl<'a> MatvecFusion<'a> {
    /// The pipeline defines of these stages (binding numbers after W, X, Y and `first_extra`).
    fn defines(&self, ncols: u32, first_extra: u32) -> Vec<(&'static str, String)> {
        let mut next = first_extra;
        let mut take = || {
            next += 1;
            (next - 1).to_string()
        };
        let mut d = Vec::new();
        match self.input {
            MatvecInput::Plain => {}
            MatvecInput::Rms { store, .. } => {
                d.push(("PRE", "rms".into()));
                d.push(("NC4", ncols.div_ceil(4).to_string()));
                d.push(("B_NORM", take()));
                if store.is_some() {
                    d.push(("XN_STORE", "1".into()));
                    d.push(("B_XN", take()));
                }
            }
            MatvecInput::SiluMul { .. } => d.push(("PRE", "silu_mul".into())),
            MatvecInput::HeadRms { heads, head_dim, .. } => {
                d.push(("PRE", "head_rms".into()));
                d.push(("HEADS", heads.to_string()));
                d.push(("HD4", (head_dim / 4).to_string()));
                d.push(("B_SQ", take()));
            }
        }
        match self.output {
            MatvecOutput::Store => {}
            MatvecOutput::AddTo { .. } => {
                d.push(("EPI", "add".into()));
                d.push(("B_RES", take()));
            }
            MatvecOutput::Conv { .. } => {
                d.push(("EPI", "conv".into()));
                d.push(("B_CW", take()));
                d.push(("B_ST", take()));
                d.push(("B_SL", take()));
            }
        }
        d
    }

    /// The extra bindings, in the order `defines` numbered them.
    fn bindings(&self) -> Vec<Binding<'a>> {
        let mut b = Vec::new();
        match self.input {
            MatvecInput::Rms { weight, store, .. } => {
                b.push(weight.all());
                b.extend(store.map(GpuBuffer::all));
            }
            MatvecInput::HeadRms { sums, .. } => b.push(sums.all()),
            MatvecInput::Plain | MatvecInput::SiluMul { .. } => {}
        }
        match self.output {
            MatvecOutput::Store => {}
            MatvecOutput::AddTo { residual } => b.push(residual.all()),
            MatvecOutput::Conv {
                weights,
                state,
                slots,
                ..
            } => b.extend([weights.all(), state.all(), slots.all()]),
        }
        b
    }

    /// Its fields of the kernel's parameters.
    fn params(&self, p: &mut MatvecParams) {
        match self.input {
            MatvecInput::Plain => {}
            MatvecInput::Rms { eps, .. } => p.eps = eps,
            MatvecInput::SiluMul { up } => p.pre_offset = up,
            MatvecInput::HeadRms {
                parts,
                offset,
                stride,
                eps,
                ..
            } => {
                p.eps = eps;
                p.head_parts = parts;
                p.sq_offset = offset;
                p.sq_stride = stride;
            }
        }
        if let MatvecOutput::Conv {
            slots_offset,
            channels,
            taps,
            state_stride,
            ..
        } = self.output
        {
            p.conv_rows = channels;
            p.taps = taps;
            p.state_stride = state_stride;
            p.slots_offset = slots_offset;
        }
    }
}

crate::gpu_params! {
    struct MatmulParams {
        /// Weights per row, rows in this window (per expert with MOE), bytes per row, byte offset of row 0 in W.
        k: u32,
        rows: u32,
        row_bytes: u32,
        w_offset: u32,
        /// Activation columns (dense); X column n starts at float x_offset + n * x_stride (multiples of 4).
        n: u32,
        x_offset: u32,
        x_stride: u32,
        /// Y[y_offset + n * y_stride + m].
        y_offset: u32,
        y_stride: u32,
        /// MOE: ids per token, the X column of an entry, the experts this binding window holds, and
        /// where moe_group.wgsl put the expert offsets, the tile table and the sorted entries.
        n_used: u32,
        x_col_token: u32,
        x_col_slot: u32,
        expert_first: u32,
        expert_count: u32,
        offsets_at: u32,
        tiles_at: u32,
        order_at: u32,
        /// K per split (a multiple of every kernel's K step; ≥ k when unsplit) and floats between the
        /// splits' outputs in Y.
        k_split: u32,
        split_stride: u32,
        /// The decode stages of matmul_coop.wgsl (PRE, EPI; unsplit, dense), as in matvec.wgsl: the
        /// norm's epsilon; EPI=conv's channels, taps, floats of state per slot and column 0's index in
        /// SLOTS; PRE=head_rms's partial sums per head, column 0's first sum and the sums' column stride.
        eps: f32,
        conv_rows: u32,
        taps: u32,
        state_stride: u32,
        slots_offset: u32,
        head_parts: u32,
        sq_offset: u32,
        sq_stride: u32,
    }
}

/// Steps (rows × K / weights per step) up to which a mat-vec counts as small (see
/// [`MatvecShape::for_matrix`]): one step per invocation is then at most ~16 waves of an H200's
/// 270 k resident invocations; larger matrices keep every invocation busy with the tuned shapes.
const SMALL_MATRIX_STEPS: u64 = 4 << 20;

/// Steps of K over all rows from which a norm-fused small mat-vec counts as large (takes 8 rows per
/// workgroup): the decode step's q‖k‖v‖z (1.6 M) and attention q‖k‖v (1.2 M), not the GDN output
/// projection (0.5 M) or the router (0.13 M).
const BIG_NORM_STEPS: u64 = 1 << 20;

/// Columns one workgroup of a small dense mat-vec ([`MatvecShape::for_matrix`]) takes at most; a
/// dispatch of more splits them into equal groups where they divide evenly. The default of the
/// engine's `dense_group_cols`; H200, 48 layers, 8 slots chained (2026-12-04): 739 tok/s at 4, 722
/// at 2, 678 at 8 (no groups).
pub const DENSE_GROUP_COLS: u32 = 4;

/// `groups` if `ncols` columns split into that many equal groups, else 1 (one group of all).
fn equal_groups(ncols: u32, groups: u32) -> u32 {
    let g = groups.max(1);
    if ncols.is_multiple_of(g) { g } else { 1 }
}

/// How a dense mat-vec's launch shape is chosen ([`matvec_shaped`]).
#[derive(Clone, Copy, Debug)]
pub enum MatvecLaunch {
    /// [`MatvecShape::for_matrix_grouped`] with at most this many columns per workgroup, for each
    /// chunk of up to [`MATVEC_MAX_COLS`] columns (the engine's `dense_group_cols`).
    ForMatrix { group_cols: u32 },
    /// This shape for every chunk (tuning runs, tests).
    Shape(MatvecShape),
}

impl MatvecLaunch {
    pub const DEFAULT: MatvecLaunch = MatvecLaunch::ForMatrix {
        group_cols: DENSE_GROUP_COLS,
    };
}

/// None: the default.
impl From<Option<MatvecShape>> for MatvecLaunch {
    fn from(shape: Option<MatvecShape>) -> MatvecLaunch {
        shape.map_or(MatvecLaunch::DEFAULT, MatvecLaunch::Shape)
    }
}

/// A mat-vec launch shape: rows per workgroup, invocations per workgroup (a power of two ≥ the
/// subgroup size) and K steps per loop iteration of the word paths. [`MatvecShape::default_for`]
/// is what every op uses; tuning runs (benches/kernels.rs) pass others to [`matvec_shaped`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatvecShape {
    pub rows: u32,
    pub wg: u32,
    pub unroll: u32,
    pub lookup: Iq4Lookup,
    /// Dense products: the dispatch's columns split into this many equal groups, one group per
    /// workgroup (1: every workgroup takes every column). A count that does not divide the columns
    /// is taken as 1.
    pub col_groups: u32,
}

/// Where the IQ4_XS decoder finds the 16 values its nibbles name: a table in workgroup memory
/// (every device), or one register per subgroup lane read with shuffles, which needs no table fill
/// and barrier before the workgroup's first weight load. The same values and the same sums either
/// way; `Shuffle` falls back to `Table` where subgroups are missing or narrower than 16 lanes, on a
/// workgroup narrower than 16, and for every other type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Iq4Lookup {
    #[default]
    Table,
    Shuffle,
}

impl Iq4Lookup {
    /// What a kernel of type `ty` and `wg` invocations on this device really uses.
    pub fn effective(self, gpu: &Gpu, ty: GgmlType, wg: u32) -> Iq4Lookup {
        let fits =
            ty == GgmlType::IQ4XS && gpu.caps.subgroups && gpu.caps.subgroup_min_size >= 16 && wg >= 16;
        if self == Iq4Lookup::Shuffle && fits {
            Iq4Lookup::Shuffle
        } else {
            Iq4Lookup::Table
        }
    }
}

impl MatvecShape {
    /// A shape with the table lookup (tuning runs and tests name the rest).
    pub const fn new(rows: u32, wg: u32, unroll: u32) -> Self {
        MatvecShape {
            rows,
            wg,
            unroll,
            lookup: Iq4Lookup::Table,
            col_groups: 1,
        }
    }

    /// The same shape with the columns split into `groups` groups.
    pub const fn with_col_groups(self, groups: u32) -> Self {
        MatvecShape {
            col_groups: groups,
            ..self
        }
    }

    /// The column groups a dispatch of `ncols` columns really uses.
    pub fn groups_for(self, ncols: u32) -> u32 {
        equal_groups(ncols, self.col_groups)
    }

    /// The same shape with the IQ4_XS values found by `lookup`.
    pub const fn with_lookup(self, lookup: Iq4Lookup) -> Self {
        MatvecShape { lookup, ..self }
    }

    /// Rows per workgroup and workgroup size (ggml uses 1–4 rows per
    /// workgroup and one to four subgroups). IQ4_XS defaults to 8 rows × 32 invocations, Q8_0, Q4_K
    /// and Q6_K to 4 × 32: best of the shapes swept on the H200 (2026-11-29, 256 MiB, K = 4096, one
    /// column: IQ4_XS 1.53 TB/s vs 1.01 at 2 × 64, Q8_0 2.3–2.4 vs 2.2, Q4_K 1.29 vs 1.13, Q6_K 1.49
    /// vs 1.39); the rest keep 2 × 64. Word paths (IQ4_XS, Q8_0, Q4_K) take 2 steps per iteration
    /// for one or two columns, 1 beyond (their activation registers would crowd out occupancy).
    pub fn default_for(ty: GgmlType, ncols: u32) -> Self {
        let (rows, wg) = match ty {
            GgmlType::IQ4XS => (8, 32),
            GgmlType::Q8_0 | GgmlType::Q4K | GgmlType::Q6K => (4, 32),
            _ => (2, 64),
        };
        MatvecShape::new(rows, wg, if ncols <= 2 { 2 } else { 1 })
    }

    /// The shape of a dense mat-vec over a matrix of `rows` rows of K = `k`, with `ncols` columns and
    /// the `input` stage folded into it: [`MatvecShape::default_for`] for large matrices, which
    /// those shapes were tuned on. The decode step's small ones (0.1–10 M weights) get a workgroup
    /// wide enough that each invocation takes about one step of K, so the whole GPU has loads in
    /// flight — 8 rows × 32 invocations walking K left most of an H200 idle (130–250 GB/s on 4–9 MB
    /// matrices, H200 2026-12-01). Rows per workgroup grow with the columns (each step's activation
    /// loads serve more rows) and with a fused norm (every workgroup recomputes its columns' norms:
    /// 1 row per workgroup made dn.qkv slower). The workgroup width, which fixes how K is split and so
    /// each row's sum, depends on K alone: a row's result is the same in any batch.
    pub fn for_matrix(ty: GgmlType, rows: u64, k: u64, ncols: u32, input: &MatvecInput<'_>) -> Self {
        MatvecShape::for_matrix_grouped(ty, rows, k, ncols, input, DENSE_GROUP_COLS)
    }

    /// [`MatvecShape::for_matrix`] with at most `group_cols` columns per workgroup (1–8; 8 never
    /// groups a dispatch's columns).
    pub fn for_matrix_grouped(
        ty: GgmlType,
        rows: u64,
        k: u64,
        ncols: u32,
        input: &MatvecInput<'_>,
        group_cols: u32,
    ) -> Self {
        let norm = matches!(input, MatvecInput::Rms { .. } | MatvecInput::HeadRms { .. });
        // Weights one invocation takes per step on the word paths (16: IQ4_XS, Q4_K, Q6_K pairs of
        // words), 8 elsewhere.
        let per_step = match ty {
            GgmlType::IQ4XS | GgmlType::Q4K | GgmlType::Q6K => 16,
            _ => 8,
        };
        let steps = k / per_step;
        if rows * steps > SMALL_MATRIX_STEPS {
            return MatvecShape::default_for(ty, ncols);
        }
        // Columns beyond `group_cols` go in equal groups (the weights, a few MB, are read once per
        // group, from L2 after the first); rows per workgroup follow a group's columns.
        let col_groups = equal_groups(ncols, ncols.div_ceil(group_cols.max(1)));
        let ncols = ncols / col_groups;
        // Rows per workgroup. The large norm-fused projections (the q‖k‖v‖z, 12,288 × 2048
        // IQ4_XS, and attention's q‖k‖v) take 8: in the kernel bench's sweep with the clocks held
        // (H200, 2026-12-02, session 11) the q‖k‖v‖z at 8 rows × 64 took 16.6 µs for 1 column and
        // 53.5 for 8, at 4 rows 22.1 and 66.7, and the engine profile's q‖k‖v‖z fell from 1,038 to
        // 898 µs per step at 1 column. The rest keep 4: at 8 rows the GDN output projection and
        // the router were slower in that engine profile (+96 and +98 µs per step), though the
        // kernel bench had the router faster (at 8 columns it measured 8 rows at 19.6 µs against
        // 9.8 at 4). The output projections (2048 × 4096 IQ4_XS, residual added; the GDN one with
        // the head RMS, whose per-workgroup cost is a few sums, not a pass over X) take 8 from
        // five columns: since the workgroup's sums go through one exchange (session 12), at 8
        // columns they took 22.3 (GDN) and 21.2 µs (attention) at 8 rows against 27.1 and 25.6 at
        // 4 (H200, 2026-12-02, clocks held); at 4 columns 16.2 against 16.3, so 4 stay below five.
        let big = rows * steps >= BIG_NORM_STEPS;
        let rows_per_group = match input {
            MatvecInput::Rms { .. } | MatvecInput::HeadRms { .. } if big => 8,
            MatvecInput::HeadRms { .. } if ncols >= 5 => 8,
            MatvecInput::Rms { .. } | MatvecInput::HeadRms { .. } => 4,
            MatvecInput::Plain | MatvecInput::SiluMul { .. } => match ncols {
                5.. => 8,
                3.. => 4,
                2 => 2,
                _ => 1,
            },
        };
        // With a fused norm over K = 2048 (the models' n_embd) the word paths take two steps per
        // invocation: the norm-fused q‖k‖v‖z at 4 × 64 took 24.5 µs for 1 column and 81.5 for 8,
        // at 4 × 128 28.4 and 101.5 (H200, 2026-12-02).
        let per_invocation = if norm && per_step == 16 && k <= 2048 { 2 } else { 1 };
        let wg = ((steps / per_invocation).next_power_of_two() as u32).clamp(32, 256);
        MatvecShape::new(rows_per_group, wg, 1).with_col_groups(col_groups)
    }

    /// Whether the shader takes this shape as it is ([`MatvecShape::clamped`] leaves it alone).
    pub fn is_within_limits(self) -> bool {
        self == self.clamped()
    }

    /// Within what the shader takes: 1–16 rows, a power-of-two workgroup of 8–1024, 1–4 steps.
    fn clamped(self) -> Self {
        MatvecShape {
            rows: self.rows.clamp(1, 16),
            wg: self.wg.clamp(8, 1024).next_power_of_two(),
            unroll: self.unroll.clamp(1, 4),
            lookup: self.lookup,
            col_groups: self.col_groups.clamp(1, MATVEC_MAX_COLS),
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn matvec_pipeline(
    gpu: &Gpu,
    ty: GgmlType,
    ncols: u32,
    moe: bool,
    shape: MatvecShape,
    fusion: &MatvecFusion<'_>,
    extra: &[(&'static str, String)],
) -> Result<std::sync::Arc<crate::gpu::Pipeline>> {
    let mut defines = vec![
        ("QTYPE", qtype_name(ty).into()),
        ("NC", ncols.to_string()),
        ("NR", shape.rows.to_string()),
        ("ACC4", (shape.rows * ncols).div_ceil(4).to_string()),
        ("WG", shape.wg.to_string()),
        ("MOE", u32::from(moe).to_string()),
        ("UNROLL", shape.unroll.to_string()),
        ("SG_MIN", gpu.caps.subgroup_min_size.max(1).to_string()),
    ];
    if shape.col_groups > 1 && !moe {
        defines.push(("CG", shape.col_groups.to_string()));
    }
    if shape.lookup.effective(gpu, ty, shape.wg) == Iq4Lookup::Shuffle {
        defines.push(("KV_SHUFFLE", "1".into()));
    }
    if moe {
        defines.push(("B_IDS", "3".into()));
    }
    defines.extend(fusion.defines(ncols, 3 + u32::from(moe)));
    defines.extend(extra.iter().cloned());
    gpu.pipeline(&MATVEC, &defines, &[])
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
    let fusion = MatvecFusion::default();
    matvec_with(gpu, rec, w, x, y, ncols, &fusion, MatvecLaunch::DEFAULT, None)
}

/// [`matvec_fused`] of `w` and, with `extra`, in the same dispatch, of that F32 matrix over the
/// same input (same K, one binding, its rows written after `w`'s in each output column, no output
/// stage applied to them): the decode step's beta/alpha projection beside q‖k‖v‖z. With `extra`,
/// `fusion`'s output must store (or conv) rather than add. Launched as `launch` says: an engine's
/// column grouping, or a shape of a tuning run or a test (`Some(shape)`; None is the default).
#[allow(clippy::too_many_arguments)]
pub fn matvec_shaped(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    w: &WeightTensor,
    extra: Option<&WeightTensor>,
    x: Columns<'_>,
    y: Columns<'_>,
    ncols: u32,
    fusion: &MatvecFusion<'_>,
    launch: impl Into<MatvecLaunch>,
) -> Result<()> {
    matvec_with(gpu, rec, w, x, y, ncols, fusion, launch.into(), extra)
}

/// [`matvec`] with fused input and output stages (see [`MatvecFusion`]).
pub fn matvec_fused(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    w: &WeightTensor,
    x: Columns<'_>,
    y: Columns<'_>,
    ncols: u32,
    fusion: &MatvecFusion<'_>,
) -> Result<()> {
    matvec_with(gpu, rec, w, x, y, ncols, fusion, MatvecLaunch::DEFAULT, None)
}

/// Whether [`matvec_coop`] can run this product here: a cooperative-matrix adapter, a dense
/// quantised or f16 matrix in one binding window, at most 16 columns, and stages it has (not a
/// norm that also stores its output, nor the experts' SiLU·mul input).
pub fn matvec_coop_fits(gpu: &Gpu, w: &WeightTensor, ncols: u32, fusion: &MatvecFusion<'_>) -> bool {
    let stages = !matches!(
        fusion.input,
        MatvecInput::SiluMul { .. } | MatvecInput::Rms { store: Some(_), .. }
    );
    stages
        && w.experts == 1
        && w.ty != GgmlType::F32
        && w.windows.len() == 1
        && (1..=CoopTile::NARROW_128X16.cols).contains(&ncols)
        && coop_accumulator(gpu, CoopTile::NARROW_128X16).is_some()
}

/// A decode step's dense product on tensor cores: y[:, j] = W · x[:, j] for j < `ncols` (≤ 16),
/// with `fusion`'s stages as the mat-vec applies them, in the narrow 128 × 16 cooperative tile
/// (f16 inputs, as prefill's products; [`matvec_coop_fits`] says where it runs). One dispatch per
/// 128 rows reads each weight once for all the columns, where the mat-vec's arithmetic grows with
/// them. Its bytes are not the mat-vec's (f16 inputs, another summation order).
#[allow(clippy::too_many_arguments)]
pub fn matvec_coop(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    w: &WeightTensor,
    x: Columns<'_>,
    y: Columns<'_>,
    ncols: u32,
    fusion: &MatvecFusion<'_>,
) -> Result<()> {
    check_dense("matvec_coop", "", w, &x, &y, ncols)?;
    crate::ensure!(
        matvec_coop_fits(gpu, w, ncols, fusion),
        QkError::Engine(format!(
            "{}: no tensor-core decode product for {ncols} columns of {} here ({})",
            w.name, w.ty, gpu.adapter.name
        ))
    );
    let kernel = MatmulKernel::Coop(CoopTile::NARROW_128X16);
    matmul_dense(gpu, rec, w, x, y, ncols, kernel, 1, None, fusion)
}

/// Whether [`matvec_shaped`] takes `extra` beside `w`.
pub fn takes_f32_rows(w: &WeightTensor, extra: &WeightTensor) -> bool {
    let [win] = extra.windows.as_slice() else {
        return false;
    };
    extra.ty == GgmlType::F32
        && extra.experts == 1
        && extra.cols == w.cols
        && w.windows.len() == 1
        && w.cols.is_multiple_of(4)
        && win.offset.is_multiple_of(16)
}

#[allow(clippy::too_many_arguments)]
fn matvec_with(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    w: &WeightTensor,
    x: Columns<'_>,
    y: Columns<'_>,
    ncols: u32,
    fusion: &MatvecFusion<'_>,
    launch: MatvecLaunch,
    extra: Option<&WeightTensor>,
) -> Result<()> {
    check_dense("matvec", "; use matvec_id", w, &x, &y, ncols)?;
    check_fusion(w, fusion, ncols)?;
    let extra_rows = match extra {
        None => 0,
        Some(e) => {
            if !takes_f32_rows(w, e) || matches!(fusion.output, MatvecOutput::AddTo { .. }) {
                return Err(QkError::Engine(format!(
                    "{}: {} cannot ride in its mat-vec (F32, same K, one binding each, a \
                     storing output)",
                    w.name, e.name
                )));
            }
            check_columns(&w.name, &y, w.rows + e.rows, u64::from(ncols), false)?;
            as_u32(e.rows, "extra rows")?
        }
    };
    if let MatvecInput::SiluMul { up } = fusion.input {
        check_columns(&w.name, &x, silu_mul_len(w, up)?, u64::from(ncols), true)?;
    }
    let k = as_u32(w.cols, "K")?;
    let mut done = 0u32;
    while done < ncols {
        let nc = (ncols - done).min(MATVEC_MAX_COLS);
        let shape = match launch {
            MatvecLaunch::ForMatrix { group_cols } => {
                MatvecShape::for_matrix_grouped(w.ty, w.rows, w.cols, nc, &fusion.input, group_cols)
            }
            MatvecLaunch::Shape(shape) => shape,
        }
        .clamped();
        let extra_defines = match extra {
            None => vec![],
            Some(_) => {
                let binding = 3 + fusion.bindings().len();
                vec![("EXTRA", "1".into()), ("B_W2", binding.to_string())]
            }
        };
        let col_groups = shape.groups_for(nc);
        let shape = shape.with_col_groups(col_groups);
        let pipe = matvec_pipeline(gpu, w.ty, nc / col_groups, false, shape, fusion, &extra_defines)?;
        for win in &w.windows {
            let mut p = MatvecParams {
                k,
                rows: as_u32(win.n_rows, "rows")?,
                row_bytes: as_u32(w.row_bytes, "row bytes")?,
                w_offset: as_u32(win.offset, "window offset")?,
                x_offset: x.offset + done * x.stride,
                x_stride: x.stride,
                y_offset: y.offset + done * y.stride + as_u32(win.first_row, "row")?,
                y_stride: y.stride,
                ..Default::default()
            };
            fusion.params(&mut p);
            // This chunk's columns: where the normalised ones are stored, which slots they are,
            // where their heads' sums of squares are.
            p.pre_offset += done * k;
            p.slots_offset += done;
            p.sq_offset += done * p.sq_stride;
            let mut bindings = vec![win.buffer.all(), x.buf.all(), y.buf.all()];
            bindings.extend(fusion.bindings());
            let mut groups = as_u32(win.n_rows.div_ceil(u64::from(shape.rows)), "workgroups")?;
            if let Some(e) = extra {
                let ewin = &e.windows[0];
                p.extra_rows = extra_rows;
                p.extra_offset = as_u32(ewin.offset / 16, "extra offset")?;
                bindings.push(ewin.buffer.all());
                groups += extra_rows.div_ceil(shape.rows);
            }
            let groups = groups
                .checked_mul(col_groups)
                .ok_or_else(|| QkError::Engine(format!("{}: too many workgroups", w.name)))?;
            rec.dispatch(&pipe, &bindings, bytemuck::bytes_of(&p), gpu.grid(groups))?;
        }
        done += nc;
    }
    Ok(())
}

/// Floats of one silu·mul input column (gate, then up `up` floats later), checked.
fn silu_mul_len(w: &WeightTensor, up: u32) -> Result<u64> {
    if u64::from(up) < w.cols || !up.is_multiple_of(4) {
        return Err(QkError::Engine(format!(
            "{}: silu·mul input needs up ≥ K and a multiple of 4 (up {up}, K {})",
            w.name, w.cols
        )));
    }
    Ok(u64::from(up) + w.cols)
}

/// The fused stages' own operands: sizes and layouts the kernel will index.
fn check_fusion(w: &WeightTensor, fusion: &MatvecFusion<'_>, ncols: u32) -> Result<()> {
    let bad = |msg: String| Err(QkError::Engine(format!("{}: {msg}", w.name)));
    // The conv's channel rows and the stored input (sliced over the workgroups of the dispatch)
    // assume row 0 is in the one window.
    let stores = matches!(fusion.input, MatvecInput::Rms { store: Some(_), .. });
    if w.windows.len() > 1 && (stores || matches!(fusion.output, MatvecOutput::Conv { .. })) {
        return bad("a fused conv or input store needs the tensor in one binding".into());
    }
    if let MatvecInput::Rms { weight, store, .. } = fusion.input {
        if weight.size < w.cols * 4 {
            return bad(format!("norm weight of {} bytes for K = {}", weight.size, w.cols));
        }
        if !w.cols.is_multiple_of(4) {
            return bad("a fused norm needs K a multiple of 4".into());
        }
        if let Some(st) = store
            && st.size < w.cols * 4 * u64::from(ncols)
        {
            return bad(format!(
                "normalised-input store of {} bytes is too small",
                st.size
            ));
        }
    }
    if let MatvecInput::HeadRms {
        sums,
        heads,
        head_dim,
        parts,
        offset,
        stride,
        ..
    } = fusion.input
    {
        let per_column = u64::from(heads) * u64::from(parts);
        if u64::from(heads) * u64::from(head_dim) != w.cols
            || !head_dim.is_multiple_of(4)
            || heads == 0
            || parts == 0
            || (ncols > 1 && u64::from(stride) < per_column)
        {
            return bad(format!(
                "head norm of {heads} heads × {head_dim} ({parts} sums each, stride {stride})"
            ));
        }
        let end = u64::from(offset) + u64::from(ncols.max(1) - 1) * u64::from(stride) + per_column;
        if sums.size < end * 4 {
            return bad(format!("head sums of {} bytes, need {}", sums.size, end * 4));
        }
    }
    if let MatvecOutput::Conv {
        weights,
        state,
        slots,
        slots_offset,
        channels,
        taps,
        state_stride,
    } = fusion.output
    {
        if u64::from(channels) > w.rows || taps == 0 || taps > 8 {
            return bad(format!("conv of {channels} channels with {taps} taps"));
        }
        if weights.size < u64::from(channels) * u64::from(taps) * 4
            || u64::from(state_stride) < u64::from(channels) * u64::from(taps - 1)
            || slots.size < (u64::from(slots_offset) + u64::from(ncols)) * 4
        {
            return bad("conv weights, state stride or slot table too small".into());
        }
        // The slots' states are checked by whoever fills the slot table; this bounds the buffer.
        if state.size < u64::from(state_stride) * 4 {
            return bad("conv state smaller than one slot".into());
        }
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

/// Checks a MoE product's operands (x holds the tokens' columns, or with `PerSlot` the slots'; y
/// the slots') and returns the shaders' X column mapping (x_col_token, x_col_slot).
fn check_moe(
    w: &WeightTensor,
    x: &Columns<'_>,
    y: &Columns<'_>,
    n_used: u32,
    n_tokens: u32,
    input: MoeInput,
    x_len: u64,
) -> Result<(u32, u32)> {
    let slots = u64::from(n_used) * u64::from(n_tokens);
    let (x_cols, mapping) = match input {
        MoeInput::PerToken => (u64::from(n_tokens), (1, 0)),
        MoeInput::PerSlot => (slots, (n_used, 1)),
    };
    check_columns(&w.name, x, x_len, x_cols, true)?;
    check_columns(&w.name, y, w.rows, slots, false)?;
    Ok(mapping)
}

/// The binding windows of an expert stack, each with its first expert and expert count.
fn expert_windows(w: &WeightTensor) -> Result<Vec<(&crate::gpu::WeightWindow, u32, u32)>> {
    w.windows
        .iter()
        .map(|win| {
            if win.first_row % w.rows != 0 || win.n_rows % w.rows != 0 {
                return Err(QkError::Engine(format!(
                    "{}: window splits an expert (expert larger than a binding)",
                    w.name
                )));
            }
            Ok((
                win,
                as_u32(win.first_row / w.rows, "expert")?,
                as_u32(win.n_rows / w.rows, "experts")?,
            ))
        })
        .collect()
}

/// MoE expert mat-vec: for each token t < n_tokens and slot s < n_used, expert
/// e = ids[offset + t·n_used + s] (read on the GPU) gives y[:, t·n_used + s] = W_e · x[:, …].
/// Multi-token calls re-read each expert per token: prefill takes [`matmul_id`] instead.
pub fn matvec_id(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    w: &WeightTensor,
    x: Columns<'_>,
    y: Columns<'_>,
    ids: ExpertIds<'_>,
    input: MoeInput,
) -> Result<()> {
    matvec_id_with(gpu, rec, w, x, y, ids, input, MatvecInput::Plain, None)
}

/// Routing done inside the expert mat-vec (matvec.wgsl `ROUTE`): token t's expert logits at float
/// `offset + t·stride` of `logits` (`experts` of them; with `shared`, the shared expert's gate logit
/// right after them and its rows appended as expert `experts`), the picks written to the ids buffer
/// and to `weights` as the router would (k = n_used, less one with `shared`).
#[derive(Clone, Copy, Debug)]
pub struct MoeRoute<'a> {
    pub logits: &'a GpuBuffer,
    pub offset: u32,
    pub stride: u32,
    pub experts: u32,
    pub shared: bool,
    pub weights: &'a GpuBuffer,
}

/// [`matvec_id`] of a token-input product (gate/up) that routes its tokens itself; None where this
/// device cannot route in a kernel (see [`route_lanes`]): use the router dispatch instead.
#[allow(clippy::too_many_arguments)]
pub fn matvec_id_routed(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    w: &WeightTensor,
    x: Columns<'_>,
    y: Columns<'_>,
    ids: ExpertIds<'_>,
    route: &MoeRoute<'_>,
    shape: Option<MatvecShape>,
) -> Result<()> {
    let call = ExpertCall {
        route: Some(route),
        shape,
        ..ExpertCall::new(MoeInput::PerToken)
    };
    expert_matvec(gpu, rec, w, x, y, ids, &call)
}

/// Lanes of the subgroup that routes a token inside a kernel on this device, if it can: subgroups of
/// one fixed size (common_route.wgsl), few enough experts per lane for registers.
pub fn route_lanes(gpu: &Gpu, experts: u32) -> Option<u32> {
    let c = &gpu.caps;
    let sg = c.subgroup_max_size;
    (c.subgroups && sg == c.subgroup_min_size && (8..=64).contains(&sg) && experts.div_ceil(sg) <= 64)
        .then_some(sg)
}

/// [`matvec_id`] with a fused input stage (plain or silu·mul; the norm is not offered here) and a
/// launch shape (None: the default; others for tuning runs).
#[allow(clippy::too_many_arguments)]
pub fn matvec_id_with(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    w: &WeightTensor,
    x: Columns<'_>,
    y: Columns<'_>,
    ids: ExpertIds<'_>,
    input: MoeInput,
    pre: MatvecInput<'_>,
    shape: Option<MatvecShape>,
) -> Result<()> {
    let call = ExpertCall {
        pre,
        shape,
        ..ExpertCall::new(input)
    };
    expert_matvec(gpu, rec, w, x, y, ids, &call)
}

/// The MoE's expert products of a decode step and their weighted sum in one dispatch
/// (matvec.wgsl `SUM`): for each token t, y[:, t] += Σ_s weights[offset + t·n_used + s] ·
/// W_{e_s} · x[:, t·n_used + s] with e_s = ids[offset + t·n_used + s] (`weights` laid out like the
/// ids), x read through `pre` (plain or silu·mul). One workgroup walks all of a token's picks for
/// its rows, so the sum needs no kernel and no per-pick output of its own; a row's sum is the same
/// whatever the other tokens of the batch. `shape` None is the default launch shape.
#[allow(clippy::too_many_arguments)]
pub fn matvec_id_sum(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    w: &WeightTensor,
    x: Columns<'_>,
    y: Columns<'_>,
    ids: ExpertIds<'_>,
    weights: &GpuBuffer,
    pre: MatvecInput<'_>,
    shape: Option<MatvecShape>,
) -> Result<()> {
    let call = ExpertCall {
        pre,
        sum: Some(weights),
        shape,
        ..ExpertCall::new(MoeInput::PerSlot)
    };
    expert_matvec(gpu, rec, w, x, y, ids, &call)
}

/// How one expert mat-vec dispatch reads and writes: the activation columns, the fused input stage,
/// routing inside the kernel, the weighted sum over picks (`sum`: the routing weights) and the
/// launch shape (None: the default).
struct ExpertCall<'a> {
    input: MoeInput,
    pre: MatvecInput<'a>,
    route: Option<&'a MoeRoute<'a>>,
    sum: Option<&'a GpuBuffer>,
    shape: Option<MatvecShape>,
}

impl ExpertCall<'_> {
    fn new(input: MoeInput) -> Self {
        ExpertCall {
            input,
            pre: MatvecInput::Plain,
            route: None,
            sum: None,
            shape: None,
        }
    }
}

/// The default launch shapes of the decode step's expert products (kernel bench on the H200,
/// 2026-12-01, the 80B MoE layer in IQ4_XS, clocks held up, benches/RESULTS.md): per-pick gate/up
/// at the type's rows × 64 invocations × 1 step (1 token 17–19 µs and 8 tokens 73–75 µs for any
/// 4–8 rows at 32 or 64 invocations); the weighted-sum down projection (picks × K long) at 8 rows ×
/// 128 invocations × 1 step (1 token 14.7 µs, 8 tokens 50.1, against 17.2 and 57.2 at 4 × 64 × 2,
/// and 95 for 8 tokens as a per-pick product plus the sum kernel). Neither width depends on the
/// batch, so neither does a row's sum.
pub fn expert_shape(ty: GgmlType, sum: bool) -> MatvecShape {
    if sum {
        return MatvecShape::new(8, 128, 1);
    }
    MatvecShape::new(MatvecShape::default_for(ty, 1).rows, 64, 1)
}

/// The default shape of one expert call: [`expert_shape`], with the IQ4_XS values from subgroup
/// shuffles for one token's routed gate/up and weighted-sum down projection, where no table fill and
/// barrier delay the few workgroups' first loads (kernel bench `moe_cold`, H200 2026-12-03, cold
/// weights, two passes: routed gate/up 18.6–18.9 → 17.8–17.9 µs, down+sum 12.5–12.6 → 10.6–10.8).
/// The table stays for the plain gate/up and for several tokens, which were slower with shuffles
/// (1 token 12.9–13.3 → 14.4–14.7 µs; 8 tokens gate/up 60.9–61.5 → 65.0–65.2, down+sum 41.4 →
/// 41.9–43.0). In the engine (48 layers, same lease, benches/RESULTS.md) one stream's chained step
/// went 3.768 → 3.627 ms; 8 slots unchanged. Same bytes either way, so a row's result does not
/// depend on the batch.
pub fn expert_call_shape(ty: GgmlType, sum: bool, routed: bool, n_tokens: u32) -> MatvecShape {
    let shape = expert_shape(ty, sum);
    if n_tokens == 1 && (sum || routed) {
        shape.with_lookup(Iq4Lookup::Shuffle)
    } else {
        shape
    }
}

fn expert_matvec(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    w: &WeightTensor,
    x: Columns<'_>,
    y: Columns<'_>,
    ids: ExpertIds<'_>,
    call: &ExpertCall<'_>,
) -> Result<()> {
    let pre = call.pre;
    let fusion = MatvecFusion {
        input: pre,
        output: MatvecOutput::Store,
    };
    let x_len = match pre {
        MatvecInput::Plain => w.cols,
        MatvecInput::SiluMul { up } => silu_mul_len(w, up)?,
        MatvecInput::Rms { .. } | MatvecInput::HeadRms { .. } => {
            return Err(QkError::Engine(format!(
                "{}: expert mat-vec input must be plain or silu·mul",
                w.name
            )));
        }
    };
    let ExpertIds {
        buf: ids,
        offset: ids_offset,
        n_used,
        n_tokens,
    } = ids;
    let slots = u64::from(n_used) * u64::from(n_tokens);
    let (x_col_token, x_col_slot) = match call.sum {
        // One output column per token.
        Some(_) => {
            if call.route.is_some() || call.input != MoeInput::PerSlot {
                return Err(QkError::Engine(format!(
                    "{}: a weighted-sum expert product reads per-pick columns and is not routed",
                    w.name
                )));
            }
            check_columns(&w.name, &x, x_len, slots, true)?;
            check_columns(&w.name, &y, w.rows, u64::from(n_tokens), false)?;
            (n_used, 1)
        }
        None => check_moe(w, &x, &y, n_used, n_tokens, call.input, x_len)?,
    };
    if (u64::from(ids_offset) + slots) * 4 > ids.size {
        return Err(QkError::Engine(format!(
            "{}: ids buffer holds fewer than {slots} ids",
            w.name
        )));
    }
    if let Some(sw) = call.sum {
        require_len("routing weights", sw, u64::from(ids_offset) + slots)?;
    }
    let max = gpu.caps.max_workgroups_per_dim;
    if n_used > max || n_tokens > max {
        return Err(QkError::Engine(format!(
            "{}: {n_used} slots × {n_tokens} tokens exceeds the grid",
            w.name
        )));
    }
    let shape = call
        .shape
        .unwrap_or_else(|| expert_call_shape(w.ty, call.sum.is_some(), call.route.is_some(), n_tokens))
        .clamped();
    let mut extra = Vec::new();
    let mut route_params = [0u32; 4];
    if call.sum.is_some() {
        extra = vec![
            ("SUM", "1".to_string()),
            ("EPI", "accumulate".to_string()),
            ("B_SW", "4".to_string()),
        ];
    }
    if let Some(r) = call.route {
        let sg = route_lanes(gpu, r.experts).ok_or_else(|| {
            QkError::Engine(format!("{}: this device cannot route inside a kernel", w.name))
        })?;
        let k = n_used - u32::from(r.shared);
        if k == 0 || k > crate::ops::router::MAX_K || r.experts > crate::ops::router::MAX_EXPERTS {
            return Err(QkError::Engine(format!(
                "{}: top-{k} of {} experts",
                w.name, r.experts
            )));
        }
        let last = u64::from(r.offset)
            + u64::from(n_tokens.max(1) - 1) * u64::from(r.stride)
            + u64::from(r.experts + u32::from(r.shared));
        require_len("routed logits", r.logits, last)?;
        require_len("routed weights", r.weights, u64::from(ids_offset) + slots)?;
        extra = vec![
            ("ROUTE", "1".to_string()),
            ("RSG", sg.to_string()),
            ("PER_LANE", r.experts.div_ceil(sg).to_string()),
            ("B_RW", "4".to_string()),
            ("B_RL", "5".to_string()),
        ];
        route_params = [r.offset, r.stride, r.experts, u32::from(r.shared)];
    }
    let pipe = matvec_pipeline(gpu, w.ty, 1, true, shape, &fusion, &extra)?;
    // Picks past the grid's y axis are walked inside the workgroup with SUM.
    let grid_slots = if call.sum.is_some() { 1 } else { n_used };
    for (win, expert_first, expert_count) in expert_windows(w)? {
        let mut p = MatvecParams {
            k: as_u32(w.cols, "K")?,
            rows: as_u32(w.rows, "rows")?,
            row_bytes: as_u32(w.row_bytes, "row bytes")?,
            w_offset: as_u32(win.offset, "window offset")?,
            x_offset: x.offset,
            x_stride: x.stride,
            y_offset: y.offset,
            y_stride: y.stride,
            ids_offset,
            n_used,
            expert_first,
            expert_count,
            x_col_token,
            x_col_slot,
            ..Default::default()
        };
        fusion.params(&mut p);
        [p.route_logits, p.route_stride, p.route_experts, p.route_shared] = route_params;
        let groups = as_u32(w.rows.div_ceil(u64::from(shape.rows)), "workgroups")?;
        let mut bindings = vec![win.buffer.all(), x.buf.all(), y.buf.all(), ids.all()];
        if let Some(r) = call.route {
            bindings.extend([r.weights.all(), r.logits.all()]);
        }
        if let Some(sw) = call.sum {
            bindings.push(sw.all());
        }
        rec.dispatch(
            &pipe,
            &bindings,
            bytemuck::bytes_of(&p),
            [groups, grid_slots, n_tokens],
        )?;
    }
    Ok(())
}

/// How an engine computes prefill products: a value each engine is given (never read from the
/// environment), so one process can hold engines of both kinds side by side.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// Cooperative-matrix tiles (f16 inputs, tensor cores) where the adapter offers them, for
    /// every weight type but F32 (a file that stores F32 asks for f32 products); f32 tiles elsewhere.
    #[default]
    Fast,
    /// f32 register tiles for every product (the float64-reference gates hold to 1e-6).
    Precise,
}

/// A cooperative-matrix workgroup tile: `rows` × `cols` outputs, each subgroup a `sg_rows` ×
/// `sg_cols` block of F×F accumulators (all multiples of 16; rows a multiple of sg_rows…).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CoopTile {
    pub rows: u32,
    pub cols: u32,
    pub sg_rows: u32,
    pub sg_cols: u32,
    /// K per step between barriers: 32 or 64 (the outputs are the same either way).
    pub k_step: u32,
}

impl CoopTile {
    const fn new(rows: u32, cols: u32, sg_rows: u32, sg_cols: u32, k_step: u32) -> Self {
        CoopTile {
            rows,
            cols,
            sg_rows,
            sg_cols,
            k_step,
        }
    }

    /// This tile with another K step (32 or 64); benches/kernels.rs compares them.
    pub const fn with_k_step(self, k_step: u32) -> Self {
        CoopTile { k_step, ..self }
    }

    /// 4 subgroups of 32×32: the first cooperative kernel's shape.
    pub const SQUARE_64: CoopTile = CoopTile::new(64, 64, 32, 32, DENSE_K_STEP);
    /// 8 subgroups of 64×32: each dequantised weight serves 128 columns, and each shared-memory
    /// fragment feeds 2–4 multiply-adds.
    pub const SQUARE_128: CoopTile = CoopTile::new(128, 128, 64, 32, DENSE_K_STEP);
    /// 4 subgroups of 64×32: SQUARE_128's subgroup block with half its columns, for products too
    /// narrow to give SQUARE_128 enough workgroups.
    pub const RECT_128X64: CoopTile = CoopTile::new(128, 64, 64, 32, DENSE_K_STEP);
    /// The grouped MoE product: one 16-wide column of the expert's entries (a few per expert in a
    /// prefill piece), 4 subgroups of 32×16.
    pub const MOE: CoopTile = CoopTile::new(128, MOE_TILE_COLS, 32, 16, MOE_K_STEP);
    /// The grouped MoE product for pieces that give each expert more entries than MOE holds (a
    /// 2048-row piece of the 80B model: ~40 each): 64 of them per tile, so each expert weight is
    /// dequantised once rather than once per 16; 8 subgroups of 32×32 (on the H200 4% faster than
    /// 4 of 64×32: twice the invocations share the fill; benches/kernels.rs, RESULTS.md).
    pub const MOE_WIDE: CoopTile = CoopTile::new(128, MOE_WIDE_TILE_COLS, 32, 32, MOE_K_STEP);
    /// The dense tiles, largest first.
    pub const DENSE: [CoopTile; 3] = [CoopTile::SQUARE_128, CoopTile::RECT_128X64, CoopTile::SQUARE_64];
    /// A dense tile one 16-wide matrix across (the MOE tile's shape): decode's few columns on
    /// tensor cores, which benches/kernels.rs times against the mat-vec; no product picks it yet.
    pub const NARROW_128X16: CoopTile = CoopTile::new(128, 16, 32, 16, DENSE_K_STEP);

    /// One of the DENSE tiles or NARROW_128X16, whatever its K step.
    fn is_dense(self) -> bool {
        CoopTile::DENSE
            .iter()
            .chain([&CoopTile::NARROW_128X16])
            .any(|t| t.with_k_step(self.k_step) == self)
    }

    /// One of the MOE tiles, whatever its K step.
    fn is_moe(self) -> bool {
        [CoopTile::MOE, CoopTile::MOE_WIDE]
            .iter()
            .any(|t| t.with_k_step(self.k_step) == self)
    }

    pub fn subgroups(self) -> u32 {
        (self.rows / self.sg_rows) * (self.cols / self.sg_cols)
    }

    /// Workgroup memory: the two f16 tiles (pitch k_step + 8; the IQ4_XS W tile is k-major, pitch
    /// rows + 8, no larger while rows ≥ k_step) and one F×F staging block per subgroup.
    fn workgroup_bytes(self, fragment: u32, acc_bytes: u32) -> u32 {
        (self.rows + self.cols) * (self.k_step + 8) * 2 + self.subgroups() * fragment * fragment * acc_bytes
    }

    /// Only the K steps the shader is written for.
    fn valid(self) -> bool {
        matches!(self.k_step, 32 | 64)
    }
}

/// K per step of the dense and grouped cooperative tiles (32 or 64): the same outputs either way
/// (one chain of 16-wide multiply-adds); 64 halves the barriers per weight and doubles each
/// invocation's loads in flight, at twice the workgroup memory. benches/kernels.rs prints both per
/// product (`coop…k64` beside `coop…`): for the grouped MoE tiles 32 is faster where each runs
/// (the narrow tile at 64 and 512 tokens, the wide one at 2048) on the H200 (RESULTS.md, 2026-12-01
/// late night); the dense products were last compared before the fill loops were unrolled (64
/// ahead on some shapes then): re-measure before changing.
const DENSE_K_STEP: u32 = 32;
const MOE_K_STEP: u32 = 32;

/// Which mat-mat kernel runs a prefill product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulKernel {
    /// f32 register tiles (matmul.wgsl): every adapter, f32 throughout.
    Tiled,
    /// Cooperative-matrix tiles (matmul_coop.wgsl): f16 inputs, `coop_accumulator` accumulators.
    Coop(CoopTile),
}

/// Fewest activation columns for which the cooperative kernel is chosen: below one 16-wide
/// matrix most of its tile is padding.
pub const COOP_MIN_COLS: u32 = 16;

/// Columns per tile of the grouped MoE product (both kernels), and so the tile size
/// [`group_experts`] cuts each expert's entries into unless the batch takes [`MOE_WIDE_TILE_COLS`].
pub const MOE_TILE_COLS: u32 = 16;

/// Columns per tile of the wide cooperative grouped MoE product ([`CoopTile::MOE_WIDE`]).
pub const MOE_WIDE_TILE_COLS: u32 = 64;

/// Workgroups a dense product must still give for a larger cooperative tile to be taken: about two
/// per streaming multiprocessor of the H200 (132), so a larger tile does not leave the GPU half
/// idle on the narrower projections. Not tuned by measurement yet (benches/kernels.rs prints every
/// tile for the 80B layer's products).
const WIDE_MIN_WORKGROUPS: u64 = 256;

/// The accumulator scalar (`"f32"` or `"f16"`) the cooperative mat-mat with `tile` uses on this
/// device, or None where it cannot run: it needs a square f16 configuration ([`coop_fragment`])
/// among the adapter's cooperative-matrix list (f32 accumulation preferred), shader f16, a fixed
/// subgroup size (its workgroup is whole subgroups) and room for its tiles.
pub fn coop_accumulator(gpu: &Gpu, tile: CoopTile) -> Option<&'static str> {
    use wgpu::CooperativeScalarType as S;
    let caps = &gpu.caps;
    if !tile.valid() || tile.subgroups() * caps.subgroup_max_size > caps.max_invocations {
        return None;
    }
    // At F = 8 a subgroup block of more than 16 matrices (the 64×32 blocks: 32) is not taken: on
    // lavapipe, the one 8×8 device this runs on, one such pipeline took its JIT over ten minutes.
    let fits = |acc: S, acc_bytes: u32| {
        coop_fragment(gpu, acc).is_some_and(|f| {
            (f == 16 || (tile.sg_rows / f) * (tile.sg_cols / f) <= 16)
                && caps.max_workgroup_storage >= tile.workgroup_bytes(f, acc_bytes)
        })
    };
    if fits(S::F32, 4) {
        Some("f32")
    } else if fits(S::F16, 2) {
        Some("f16")
    } else {
        None
    }
}

/// The size F of the F×F×F f16 multiply-adds into `acc` accumulators a cooperative-matrix kernel
/// can run here, if any: 16 where the adapter lists it (tensor cores), else 8 on Vulkan (Mesa's
/// lavapipe offers only 8×8×8 — 26.2 does, 25.0 not at all —: the kernels' one test bed off the GPU; naga's WGSL
/// has only these two square sizes). Metal's 8×8 simdgroup matrices are left out until the
/// kernels have run there. Also needs shader f16 and a fixed subgroup size (the kernels'
/// workgroups are whole subgroups).
pub fn coop_fragment(gpu: &Gpu, acc: wgpu::CooperativeScalarType) -> Option<u32> {
    let caps = &gpu.caps;
    let usable = caps.cooperative_matrix
        && caps.shader_f16
        && caps.subgroup_min_size == caps.subgroup_max_size
        && caps.subgroup_max_size != 0;
    let offered = |f: u32| {
        caps.cooperative_matrix_configs.iter().any(|c| {
            (c.m_size, c.n_size, c.k_size) == (f, f, f)
                && c.ab_type == wgpu::CooperativeScalarType::F16
                && c.cr_type == acc
        })
    };
    let vulkan = gpu.adapter.backend == "vulkan";
    [16, 8]
        .into_iter()
        .find(|&f| usable && offered(f) && (f == 16 || vulkan))
}

/// What kind of kernel a product over `ncols` activation columns runs. Prefill pieces are cut so
/// that the rows of one 64-aligned chunk always see the same class, whatever the piece
/// (`Engine::run`), since each class sums in its own order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ColumnClass {
    /// Up to 8 columns: the mat-vec (and the MoE mat-vec by ids).
    MatVec,
    /// f32 register tiles (and the tiled grouped MoE product).
    Tiled,
    /// Cooperative-matrix tiles for every weight type but F32.
    Coop,
}

pub fn column_class(gpu: &Gpu, precision: Precision, ncols: u32) -> ColumnClass {
    if ncols <= MATVEC_MAX_COLS {
        ColumnClass::MatVec
    } else if precision == Precision::Fast
        && ncols >= COOP_MIN_COLS
        && coop_accumulator(gpu, CoopTile::SQUARE_64).is_some()
        && coop_accumulator(gpu, CoopTile::MOE).is_some()
    {
        ColumnClass::Coop
    } else {
        ColumnClass::Tiled
    }
}

/// The cooperative tile a Coop-class product of `rows` × `ncols` uses, if any: F32 weights keep
/// f32 tiles.
fn coop_tile_for(
    gpu: &Gpu,
    precision: Precision,
    ty: GgmlType,
    ncols: u32,
    tile: CoopTile,
) -> Option<CoopTile> {
    (column_class(gpu, precision, ncols) == ColumnClass::Coop && ty != GgmlType::F32)
        .then_some(tile)
        .filter(|t| coop_accumulator(gpu, *t).is_some())
}

/// The kernel [`matmul`] uses for a dense `rows` × K × `ncols` product of a `ty` matrix: the
/// largest cooperative tile (128×128, 128×64) that still gives [`WIDE_MIN_WORKGROUPS`] workgroups
/// (K splits included), else 64×64; f32 tiles where the class is not Coop. The tile shape does not
/// change any output (every output is the same chain of 16-wide multiply-adds), so it may follow
/// the piece size.
pub fn matmul_kernel(
    gpu: &Gpu,
    precision: Precision,
    ty: GgmlType,
    rows: u64,
    k: u64,
    ncols: u32,
) -> MatmulKernel {
    let splits = u64::from(k_splits(rows, k));
    let groups = |t: CoopTile| rows.div_ceil(u64::from(t.rows)) * u64::from(ncols.div_ceil(t.cols)) * splits;
    let tile = CoopTile::DENSE
        .into_iter()
        .find(|t| {
            ncols > t.cols / 2 && groups(*t) >= WIDE_MIN_WORKGROUPS && coop_accumulator(gpu, *t).is_some()
        })
        .unwrap_or(CoopTile::SQUARE_64);
    coop_tile_for(gpu, precision, ty, ncols, tile).map_or(MatmulKernel::Tiled, MatmulKernel::Coop)
}

/// The tile width [`group_experts`] cuts a batch's entries into for the grouped products of expert
/// stacks of types `tys` over `n_tokens` tokens × `n_used` of `experts`: 64 where every product
/// runs cooperative tiles and the experts average more entries than a 16-wide tile holds (a narrow
/// tile would dequantise each expert's weights more than once; not tuned by measurement yet:
/// benches/kernels.rs prints both tiles), else 16. The tile never changes an output (each column
/// is the same chain of multiply-adds in any tile), so it may follow the piece size.
pub fn moe_tile_cols(
    gpu: &Gpu,
    precision: Precision,
    tys: &[GgmlType],
    experts: u32,
    n_used: u32,
    n_tokens: u32,
) -> u32 {
    let entries = u64::from(n_used) * u64::from(n_tokens);
    // The same accumulator type as the narrow tile, or the tile width would change the bytes.
    let wide = entries > u64::from(MOE_TILE_COLS) * u64::from(experts.max(1))
        && coop_accumulator(gpu, CoopTile::MOE_WIDE) == coop_accumulator(gpu, CoopTile::MOE)
        && tys
            .iter()
            .all(|&ty| coop_tile_for(gpu, precision, ty, n_tokens, CoopTile::MOE_WIDE).is_some());
    if wide { MOE_WIDE_TILE_COLS } else { MOE_TILE_COLS }
}

/// The kernel [`matmul_id`] uses for a grouped product of `ty` experts over a batch grouped as
/// `shape`: the cooperative tile as wide as the groups' tiles, else f32 tiles (16 wide).
pub fn matmul_id_kernel(gpu: &Gpu, precision: Precision, ty: GgmlType, shape: GroupShape) -> MatmulKernel {
    let tile = if shape.tile_cols == MOE_WIDE_TILE_COLS {
        CoopTile::MOE_WIDE
    } else {
        CoopTile::MOE
    };
    coop_tile_for(gpu, precision, ty, shape.n_tokens, tile).map_or(MatmulKernel::Tiled, MatmulKernel::Coop)
}

/// 64-row units × K splits a dense product aims for: about two workgroups per streaming
/// multiprocessor of the H200 (132) per 64-column tile, so a product with few rows (the F32 router,
/// β/α, the shared expert, the out projections) does not leave most of the GPU idle while a few
/// workgroups walk all of K.
const SPLIT_TARGET_UNITS: u64 = 256;
/// Fewest K per split: a split walks at least four 32-wide K steps.
pub const SPLIT_MIN_K: u64 = 128;
/// Most K splits of one product.
pub const MAX_SPLITS: u32 = 16;
/// A split's K is a multiple of this (every mat-mat K step divides it).
const SPLIT_ALIGN: u64 = 128;
/// Most partial floats per activation column a split product writes (splits × rows ≤ this, by
/// [`k_splits`]): what a scratch for split partials must hold per column.
pub const SPLIT_MAX_FLOATS_PER_COL: u64 = SPLIT_TARGET_UNITS * 64;

/// How many K splits a dense mat-mat of `rows` × `k` runs (1: unsplit). A function of the matrix
/// alone, never of the column count, so every row of every piece sums in the same order (docs:
/// "Determinism"). Splits × 64-row units stay within SPLIT_TARGET_UNITS, each split at least
/// SPLIT_MIN_K long.
pub fn k_splits(rows: u64, k: u64) -> u32 {
    let units = rows.div_ceil(64).max(1);
    let mut s = 1u64;
    while s * 2 <= u64::from(MAX_SPLITS) && units * s * 2 <= SPLIT_TARGET_UNITS && k >= s * 2 * SPLIT_MIN_K {
        s *= 2;
    }
    // Splits are rounded up to SPLIT_ALIGN, which may leave trailing splits empty: drop them.
    let len = split_len(k, s as u32);
    k.div_ceil(len).max(1) as u32
}

/// K per split of a `k`-long product cut into `splits`.
fn split_len(k: u64, splits: u32) -> u64 {
    k.div_ceil(u64::from(splits.max(1))).div_ceil(SPLIT_ALIGN).max(1) * SPLIT_ALIGN
}

/// Mat-mat for prefill: y[:, j] = W · x[:, j] for j < ncols, by the kernel `matmul_kernel` picks,
/// split over K as [`k_splits`] says; `partials` holds the splits' sums (splits × rows × ncols
/// floats) and may be None for products that are not split.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    w: &WeightTensor,
    x: Columns<'_>,
    y: Columns<'_>,
    ncols: u32,
    precision: Precision,
    partials: Option<&GpuBuffer>,
) -> Result<()> {
    let kernel = matmul_kernel(gpu, precision, w.ty, w.rows, w.cols, ncols);
    let splits = k_splits(w.rows, w.cols);
    matmul_split(gpu, rec, w, x, y, ncols, kernel, splits, partials)
}

/// The mat-mat pipeline of `kernel` for `ty` weights, dense or grouped (`moe`).
fn matmul_pipeline(
    gpu: &Gpu,
    name: &str,
    ty: GgmlType,
    kernel: MatmulKernel,
    moe: bool,
) -> Result<std::sync::Arc<crate::gpu::Pipeline>> {
    matmul_pipeline_with(gpu, name, ty, kernel, moe, Vec::new())
}

/// [`matmul_pipeline`] with more defines for the cooperative kernel (its decode stages).
fn matmul_pipeline_with(
    gpu: &Gpu,
    name: &str,
    ty: GgmlType,
    kernel: MatmulKernel,
    moe: bool,
    stages: Vec<(&'static str, String)>,
) -> Result<std::sync::Arc<crate::gpu::Pipeline>> {
    let moe_flag = u32::from(moe).to_string();
    match kernel {
        MatmulKernel::Tiled => {
            let tn = if moe { MOE_TILE_COLS } else { 64 };
            gpu.pipeline(
                &MATMUL,
                &[
                    ("QTYPE", qtype_name(ty).into()),
                    ("TN", tn.to_string()),
                    ("NJ", (tn / 16).to_string()),
                    ("MOE", moe_flag),
                ],
                &[],
            )
        }
        MatmulKernel::Coop(tile) => {
            let acc = coop_accumulator(gpu, tile).ok_or_else(|| {
                QkError::Engine(format!(
                    "{name}: cooperative mat-mat {tile:?} requested but {} does not offer it",
                    gpu.adapter.name
                ))
            })?;
            let acc_type = if acc == "f32" {
                wgpu::CooperativeScalarType::F32
            } else {
                wgpu::CooperativeScalarType::F16
            };
            let f = coop_fragment(gpu, acc_type).expect("coop_accumulator found a fragment");
            // The fill's loop counts (matmul_coop.wgsl checks them against the tile).
            let threads = tile.subgroups() * gpu.caps.subgroup_max_size;
            let per_invocation = |items: u32| items.div_ceil(threads);
            let mut defines = vec![
                ("QTYPE", qtype_name(ty).into()),
                ("SG", gpu.caps.subgroup_max_size.to_string()),
                ("ACC", acc.into()),
                ("TM", tile.rows.to_string()),
                ("TN", tile.cols.to_string()),
                ("WM", tile.sg_rows.to_string()),
                ("WN", tile.sg_cols.to_string()),
                ("F", f.to_string()),
                ("AM", (tile.sg_rows / f).to_string()),
                ("AN", (tile.sg_cols / f).to_string()),
                ("SGS", tile.subgroups().to_string()),
                ("TK", tile.k_step.to_string()),
                ("KK", (tile.k_step / f).to_string()),
                ("MOE", moe_flag),
                ("XH", per_invocation(tile.cols * tile.k_step / 4).to_string()),
                ("WPT", per_invocation(tile.rows * tile.k_step / 8).to_string()),
            ];
            defines.extend(stages);
            gpu.pipeline(&MATMUL_COOP, &defines, &[])
        }
    }
}

/// Rows × columns of one workgroup of `kernel`.
fn tile_shape(kernel: MatmulKernel, moe: bool) -> (u32, u32) {
    match kernel {
        MatmulKernel::Tiled => (64, if moe { MOE_TILE_COLS } else { 64 }),
        MatmulKernel::Coop(t) => (t.rows, t.cols),
    }
}

/// `matmul` with an explicit kernel, unsplit; `Coop` on a device without it is an error.
pub fn matmul_with(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    w: &WeightTensor,
    x: Columns<'_>,
    y: Columns<'_>,
    ncols: u32,
    kernel: MatmulKernel,
) -> Result<()> {
    matmul_split(gpu, rec, w, x, y, ncols, kernel, 1, None)
}

crate::gpu_params! {
    struct ReduceParams {
        /// Rows per column, columns, splits, floats between splits in PART (column n of split z starts
        /// at z · split_stride + n · rows).
        rows: u32,
        n: u32,
        splits: u32,
        split_stride: u32,
        /// Y[y_offset + n * y_stride + m].
        y_offset: u32,
        y_stride: u32,
    }
}

/// `matmul` with an explicit kernel and K cut into `splits` (a split count other than
/// [`k_splits`]' changes the sum order: tests and benches only). With more than one split, every
/// workgroup writes its K range's sums to `partials` (split z, column n at float
/// (z · ncols + n) · rows) and a second dispatch adds them in split order into y.
#[allow(clippy::too_many_arguments)]
pub fn matmul_split(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    w: &WeightTensor,
    x: Columns<'_>,
    y: Columns<'_>,
    ncols: u32,
    kernel: MatmulKernel,
    splits: u32,
    partials: Option<&GpuBuffer>,
) -> Result<()> {
    check_dense("matmul", "", w, &x, &y, ncols)?;
    matmul_dense(
        gpu,
        rec,
        w,
        x,
        y,
        ncols,
        kernel,
        splits,
        partials,
        &MatvecFusion::default(),
    )
}

/// [`matmul_split`] with `stages` (the cooperative kernel's decode stages, [`matvec_coop`]; the
/// default: none) over checked operands.
#[allow(clippy::too_many_arguments)]
fn matmul_dense(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    w: &WeightTensor,
    x: Columns<'_>,
    y: Columns<'_>,
    ncols: u32,
    kernel: MatmulKernel,
    splits: u32,
    partials: Option<&GpuBuffer>,
    stages: &MatvecFusion<'_>,
) -> Result<()> {
    if let MatmulKernel::Coop(t) = kernel
        && !t.is_dense()
    {
        return Err(QkError::Engine(format!("{}: {t:?} is not a dense tile", w.name)));
    }
    let pipe = matmul_pipeline_with(gpu, &w.name, w.ty, kernel, false, stages.defines(ncols, 3))?;
    let mut fused = MatvecParams::default();
    stages.params(&mut fused);
    let stage_bindings = stages.bindings();
    let (tm, tn) = tile_shape(kernel, false);
    let col_tiles = ncols.div_ceil(tn);
    if col_tiles > gpu.caps.max_workgroups_per_dim {
        return Err(QkError::Engine(format!(
            "{}: {ncols} columns exceed one dispatch",
            w.name
        )));
    }
    let k = as_u32(w.cols, "K")?;
    let rows = as_u32(w.rows, "rows")?;
    let splits = splits.clamp(1, MAX_SPLITS);
    let k_split = as_u32(split_len(w.cols, splits), "K split")?;
    // Splits whose K range would be empty after rounding are not dispatched.
    let splits = k.div_ceil(k_split).max(1);
    let part = if splits > 1 {
        let need = u64::from(splits) * w.rows * u64::from(ncols) * 4;
        let buf = partials.ok_or_else(|| {
            QkError::Engine(format!(
                "{}: a {splits}-way split-K product needs a partials buffer",
                w.name
            ))
        })?;
        crate::ensure!(
            need <= buf.size,
            QkError::Engine(format!(
                "{}: split-K partials need {need} bytes, buffer {} has {}",
                w.name, buf.label, buf.size
            ))
        );
        Some(buf)
    } else {
        None
    };
    for win in &w.windows {
        let first_row = as_u32(win.first_row, "row")?;
        let (out, y_offset, y_stride, split_stride) = match part {
            Some(buf) => (buf, first_row, rows, ncols * rows),
            None => (y.buf, y.offset + first_row, y.stride, 0),
        };
        let p = MatmulParams {
            k,
            rows: as_u32(win.n_rows, "rows")?,
            row_bytes: as_u32(w.row_bytes, "row bytes")?,
            w_offset: as_u32(win.offset, "window offset")?,
            n: ncols,
            x_offset: x.offset,
            x_stride: x.stride,
            y_offset,
            y_stride,
            k_split,
            split_stride,
            eps: fused.eps,
            conv_rows: fused.conv_rows,
            taps: fused.taps,
            state_stride: fused.state_stride,
            slots_offset: fused.slots_offset,
            head_parts: fused.head_parts,
            sq_offset: fused.sq_offset,
            sq_stride: fused.sq_stride,
            ..Default::default()
        };
        let row_tiles = as_u32(win.n_rows.div_ceil(u64::from(tm)), "row tiles")?;
        let mut bindings = vec![win.buffer.all(), x.buf.all(), out.all()];
        bindings.extend(stage_bindings.iter().cloned());
        rec.dispatch(
            &pipe,
            &bindings,
            bytemuck::bytes_of(&p),
            [row_tiles, col_tiles, splits],
        )?;
    }
    if let Some(buf) = part {
        let p = ReduceParams {
            rows,
            n: ncols,
            splits,
            split_stride: ncols * rows,
            y_offset: y.offset,
            y_stride: y.stride,
        };
        let pipe = gpu.pipeline(&MATMUL_REDUCE, &[], &[])?;
        rec.dispatch(
            &pipe,
            &[buf.all(), y.buf.all()],
            bytemuck::bytes_of(&p),
            [rows.div_ceil(256), ncols, 1],
        )?;
    }
    Ok(())
}

/// The shape of a batch's expert groups: `experts` in the stack, `n_used` per token, `n_tokens`
/// tokens, each expert's entries cut into tiles of at most `tile_cols` (the grouped kernel's tile
/// width: [`moe_tile_cols`]); where each part sits in the groups buffer (layout in moe_group.wgsl).
/// A buffer sized for [`MOE_TILE_COLS`] holds the groups of any tile width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupShape {
    pub experts: u32,
    pub n_used: u32,
    pub n_tokens: u32,
    pub tile_cols: u32,
}

impl GroupShape {
    fn entries(&self) -> u32 {
        self.n_used * self.n_tokens
    }

    /// Tiles of at most tile_cols entries: each expert's last tile may be partial.
    fn max_tiles(&self) -> u32 {
        self.entries().div_ceil(self.tile_cols.max(1)) + self.experts.min(self.entries())
    }

    fn offsets_at(&self) -> u32 {
        1
    }

    fn tiles_at(&self) -> u32 {
        self.offsets_at() + self.experts + 1
    }

    fn order_at(&self) -> u32 {
        self.tiles_at() + 2 * self.max_tiles()
    }

    /// u32 count of the groups buffer.
    pub fn words(&self) -> u64 {
        u64::from(self.order_at()) + u64::from(self.entries())
    }
}

/// A batch's expert groups in a u32 buffer: written by [`group_experts`] from the router's ids,
/// read by every [`matmul_id`] of the layer.
#[derive(Clone, Copy, Debug)]
pub struct ExpertGroups<'a> {
    pub buf: &'a GpuBuffer,
    pub shape: GroupShape,
}

impl ExpertGroups<'_> {
    fn check(&self, what: &str) -> Result<()> {
        let need = self.shape.words() * 4;
        crate::ensure!(
            need <= self.buf.size,
            QkError::Engine(format!(
                "{what}: expert groups need {need} bytes, buffer {} has {}",
                self.buf.label, self.buf.size
            ))
        );
        Ok(())
    }
}

crate::gpu_params! {
    struct GroupParams {
        tokens: u32,
        n_used: u32,
        experts: u32,
        ids_offset: u32,
        tile_cols: u32,
        offsets_at: u32,
        tiles_at: u32,
        order_at: u32,
    }
}

/// Sort the (token, slot) entries of `ids` by expert into `groups` (one workgroup on the GPU).
pub fn group_experts(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    ids: ExpertIds<'_>,
    groups: ExpertGroups<'_>,
) -> Result<()> {
    let g = groups.shape;
    crate::ensure!(
        ids.n_used == g.n_used && ids.n_tokens == g.n_tokens,
        QkError::Engine(format!(
            "expert groups for {}×{} ids hold {}×{}",
            ids.n_tokens, ids.n_used, g.n_tokens, g.n_used
        ))
    );
    crate::ensure!(
        g.experts >= 1 && g.experts <= super::router::MAX_EXPERTS,
        QkError::Engine(format!("expert groups: {} experts", g.experts))
    );
    crate::ensure!(
        [MOE_TILE_COLS, MOE_WIDE_TILE_COLS].contains(&g.tile_cols),
        QkError::Engine(format!("expert groups: tiles of {} columns", g.tile_cols))
    );
    let entries = u64::from(g.entries());
    if (u64::from(ids.offset) + entries) * 4 > ids.buf.size {
        return Err(QkError::Engine(format!(
            "expert ids: buffer {} holds fewer than {entries} ids",
            ids.buf.label
        )));
    }
    groups.check("group_experts")?;
    let p = GroupParams {
        tokens: g.n_tokens,
        n_used: g.n_used,
        experts: g.experts,
        ids_offset: ids.offset,
        tile_cols: g.tile_cols,
        offsets_at: g.offsets_at(),
        tiles_at: g.tiles_at(),
        order_at: g.order_at(),
    };
    let pipe = gpu.pipeline(&MOE_GROUP, &[], &[])?;
    rec.dispatch(
        &pipe,
        &[ids.buf.all(), groups.buf.all()],
        bytemuck::bytes_of(&p),
        [1, 1, 1],
    )
}

/// Grouped MoE mat-mat: for every token t < n_tokens and slot s < n_used, with e the expert the
/// router chose there, y[:, t·n_used + s] = W_e · x[:, …] (x column as in [`matvec_id`]) — the
/// same outputs as [`matvec_id`], but each expert's weights are read once per tile of its entries
/// (16 or 64: `groups.shape.tile_cols`, which must be `kernel`'s tile width) rather than once per
/// entry. `groups` must hold [`group_experts`] of this batch. One dispatch
/// per binding window of the expert stack.
#[allow(clippy::too_many_arguments)]
pub fn matmul_id(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    w: &WeightTensor,
    x: Columns<'_>,
    y: Columns<'_>,
    groups: ExpertGroups<'_>,
    input: MoeInput,
    kernel: MatmulKernel,
) -> Result<()> {
    let g = groups.shape;
    let (x_col_token, x_col_slot) = check_moe(w, &x, &y, g.n_used, g.n_tokens, input, w.cols)?;
    // A stack may hold more experts than the router picks from (the shared expert appended for
    // the decode step): those are never grouped.
    crate::ensure!(
        u64::from(g.experts) <= w.experts,
        QkError::Engine(format!(
            "{}: expert groups over {} experts for a stack of {}",
            w.name, g.experts, w.experts
        ))
    );
    groups.check(&w.name)?;
    if let MatmulKernel::Coop(t) = kernel
        && !t.is_moe()
    {
        return Err(QkError::Engine(format!(
            "{}: {t:?} is not the grouped tile",
            w.name
        )));
    }
    let (tm, tn) = tile_shape(kernel, true);
    crate::ensure!(
        tn == g.tile_cols,
        QkError::Engine(format!(
            "{}: {kernel:?} is {tn} columns wide, the expert groups' tiles {}",
            w.name, g.tile_cols
        ))
    );
    let max_tiles = g.max_tiles();
    crate::ensure!(
        max_tiles <= gpu.caps.max_workgroups_per_dim,
        QkError::Engine(format!("{}: {max_tiles} column tiles exceed the grid", w.name))
    );
    let pipe = matmul_pipeline(gpu, &w.name, w.ty, kernel, true)?;
    for (win, expert_first, expert_count) in expert_windows(w)? {
        let p = MatmulParams {
            k: as_u32(w.cols, "K")?,
            rows: as_u32(w.rows, "rows")?,
            row_bytes: as_u32(w.row_bytes, "row bytes")?,
            w_offset: as_u32(win.offset, "window offset")?,
            n: 0,
            x_offset: x.offset,
            x_stride: x.stride,
            y_offset: y.offset,
            y_stride: y.stride,
            n_used: g.n_used,
            x_col_token,
            x_col_slot,
            expert_first,
            expert_count,
            offsets_at: g.offsets_at(),
            tiles_at: g.tiles_at(),
            order_at: g.order_at(),
            k_split: as_u32(w.cols, "K")?,
            split_stride: 0,
            ..Default::default()
        };
        let row_tiles = as_u32(w.rows.div_ceil(u64::from(tm)), "row tiles")?;
        rec.dispatch(
            &pipe,
            &[win.buffer.all(), x.buf.all(), y.buf.all(), groups.buf.all()],
            bytemuck::bytes_of(&p),
            [row_tiles, max_tiles, 1],
        )?;
    }
    Ok(())
}

/// Prefill or decode, MoE: the mat-vec by ids for up to 8 tokens, the grouped mat-mat beyond
/// (`groups` must then hold [`group_experts`] of `ids`).
#[allow(clippy::too_many_arguments)]
pub fn mul_id(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    w: &WeightTensor,
    x: Columns<'_>,
    y: Columns<'_>,
    ids: ExpertIds<'_>,
    groups: ExpertGroups<'_>,
    input: MoeInput,
    precision: Precision,
) -> Result<()> {
    if column_class(gpu, precision, ids.n_tokens) == ColumnClass::MatVec {
        matvec_id(gpu, rec, w, x, y, ids, input)
    } else {
        let kernel = matmul_id_kernel(gpu, precision, w.ty, groups.shape);
        matmul_id(gpu, rec, w, x, y, groups, input, kernel)
    }
}

/// Prefill or decode: the mat-vec for up to 8 columns, the mat-mat beyond (split over K, with
/// `partials`, as [`matmul`]).
#[allow(clippy::too_many_arguments)]
pub fn mul(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    w: &WeightTensor,
    x: Columns<'_>,
    y: Columns<'_>,
    ncols: u32,
    precision: Precision,
    partials: Option<&GpuBuffer>,
) -> Result<()> {
    if ncols <= MATVEC_MAX_COLS {
        matvec(gpu, rec, w, x, y, ncols)
    } else {
        matmul(gpu, rec, w, x, y, ncols, precision, partials)
    }
}
