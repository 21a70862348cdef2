//! Full attention over a KV cache (shaders/attention.wgsl): the prepare op (q/k RMSNorm, RoPE, K/V
//! store), split flash attention for decode steps and prefill pieces with the merge that
//! normalises and gates, the cache element types, and the CPU references.
//!
//! # Interface
//!
//! * [`record_prepare`]`(gpu, rec, shape, rows, kv, args)` — one dispatch per cache buffer group
//!   (normally one): every q head of every row gets its RMSNorm (weight `q_norm`) and RoPE into
//!   `args.q_out`; every kv head's K its RMSNorm (`k_norm`) and RoPE, then K and V go into the row's
//!   cache cell in the cache types.
//! * [`record_decode`]`(gpu, rec, shape, rows_buf, n, kv, args, walk)` — a decode step: one split
//!   dispatch per buffer group (normally one) over every row, then one merge dispatch writing the
//!   gated output. Nothing in it depends on the rows' positions, so one recording serves every step
//!   once the rows buffer is rewritten.
//! * [`record_prefill`]`(gpu, rec, shape, slot, pos, n, kv, args, kernel)` — a prefill piece: `n`
//!   consecutive positions of one slot (already prepared), tiled flash attention plus the merge;
//!   [`prefill_kernel`] picks f32 tiles or cooperative-matrix ones (f16 cache, fast default).
//!
//! # Buffer layouts (every index in 4-byte words)
//!
//! * Rows buffer (`u32`): row r is the pair `[slot, pos]` at words `2r, 2r + 1`: the engine slot
//!   and the position the row's token sits at (it attends to positions `0..=pos` of its slot, its
//!   own K/V included). `slot == u32::MAX` marks a padding row: skipped, its output untouched.
//!   A prefill piece passes `(slot, pos)` as immediates instead (row r at `pos + r`).
//! * Projection rows (`f32`, [`ProjLayout`]): row r's q head h at
//!   `r * row_stride + q_offset + h * q_head_stride`, its gate (the q/gate interleave of Qwen3-Next)
//!   where [`GateLayout`] says, kv head g's K at `r * row_stride + k_offset + g * head_dim`, V at
//!   `... + v_offset + g * head_dim`.
//! * Prepared q (`f32`): row r head h at `r * heads * head_dim + h * head_dim` (packed), unscaled.
//! * KV cache of one layer: a K buffer and a V buffer per group of slots ([`KvGroup`]), element
//!   type per [`KvType`]; the cell of (slot s, position p, kv head g) is the row of
//!   `KvType::row_words(head_dim)` words at `(((s - first_slot) * ctx + p) * kv_heads + g) * row_words`,
//!   so a slot's positions `0..p` are one contiguous range (what snapshots copy).
//! * Partials (scratch, [`partial_len`]): `f32` outputs (head_dim per entry) and (max, sum) pairs,
//!   entry `(r * heads + h) * split_stride + split`, split_stride the mode's most splits
//!   ([`DECODE_MAX_SPLITS`], [`PREFILL_MAX_SPLITS`]).
//! * Output (`f32`, [`OutLayout`]): row r head h at `offset + r * row_stride + h * head_dim`.

use super::elementwise::require_len;
use super::matmul::{self, Precision};
use crate::gpu::{Gpu, GpuBuffer, Pipeline, Recorder, ShaderFile};
use crate::{QkError, Result};

pub const FILE: ShaderFile = crate::shader_file!("attention", PrepareParams, CoreParams);
/// The cooperative-matrix prefill kernel (f16 cache; [`PrefillKernel::Coop`]).
pub const COOP_FILE: ShaderFile = crate::shader_file!("attention_coop", CoreParams);

/// Decode splits: at least 32 keys each, at most 256 per row (longer caches get longer splits).
/// A decode row has only kv_heads × splits workgroups, each walking its split's keys serially: up
/// to 8192 keys stay at 32 per split (512 workgroups of one row at 2 kv heads), so a deep cache
/// costs more workgroups, not longer ones (measured on the H200: at 64 splits a row at depth 8192
/// cost ~1.4 ms more per step than at 512).
pub const DECODE_MIN_SPLIT: u32 = 32;
/// Invocations of the merge workgroup (one per row head): split groups of head_dim / 8 units each.
const MERGE_WG: u32 = 256;
pub const DECODE_MAX_SPLITS: u32 = 256;
/// Prefill splits: at least 256 keys, at most 16 per query tile (a piece of 64 tokens has only
/// 8 tiles per kv head; splits fill the GPU when the prefix is long).
pub const PREFILL_MIN_SPLIT: u32 = 256;
pub const PREFILL_MAX_SPLITS: u32 = 16;
/// Query rows (token × q head of one group) per prefill workgroup (`PR`).
pub const PREFILL_ROWS: u32 = 64;
/// Key columns per decode workgroup (`COLS`) and keys per column per iteration (`UNROLL`): 4 × 4
/// keys' K and V rows (4 KiB at head_dim 256, f16) in flight per 32-lane column.
pub const DECODE_COLS: u32 = 4;
pub const DECODE_UNROLL: u32 = 4;
/// Most invocations sharing one key in decode (`LANES`): a key's 8-dim units spread over a whole
/// 32-wide subgroup.
pub const DECODE_LANES: u32 = 32;

/// How the decode split kernel walks a row's keys: key columns per workgroup, keys per column per
/// iteration, the shortest split, and the most lanes that share a key (each lane then holds
/// head_dim / lanes of its dims; the kernel takes the largest power of two up to it that divides
/// the subgroup and the head's 8-dim units). Fewer lanes per key: fewer shuffle steps per score
/// and softmax updates per key, more dims per lane. [`DecodeTuning::DEFAULT`] unless the engine is
/// given another (`EngineOptions::attention_walk`); tuning runs (benches/kernels.rs) sweep them
/// through [`record_decode`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeTuning {
    pub cols: u32,
    pub unroll: u32,
    pub min_split: u32,
    pub lanes: u32,
}

impl DecodeTuning {
    pub const DEFAULT: DecodeTuning = DecodeTuning {
        cols: DECODE_COLS,
        unroll: DECODE_UNROLL,
        min_split: DECODE_MIN_SPLIT,
        lanes: DECODE_LANES,
    };

    /// Within what the kernel takes: 1–16 columns, 1–8 keys per column, a power-of-two shortest
    /// split, a power of two from 1 to 32 lanes per key.
    pub fn check(&self) -> Result<()> {
        crate::ensure!(
            (1..=16).contains(&self.cols)
                && (1..=8).contains(&self.unroll)
                && self.min_split.is_power_of_two()
                && self.lanes.is_power_of_two()
                && self.lanes <= 32,
            QkError::Engine(format!(
                "attention walk: {} columns (1-16), {} keys per column (1-8), shortest split {} (a power of two), {} lanes per key (a power of two, 1-32)",
                self.cols, self.unroll, self.min_split, self.lanes
            ))
        );
        Ok(())
    }
}
/// Keys per K/V block staged in workgroup memory by the prefill kernel (`BK`).
pub const PREFILL_KEYS: u32 = 16;
/// Subgroups of the cooperative prefill workgroup, and the keys of its staged K/V blocks
/// (attention_coop.wgsl's BC; its rows per tile are [`PREFILL_ROWS`]).
const COOP_SUBGROUPS: u32 = 8;
const COOP_KEYS: u32 = 32;

/// Which kernel computes a prefill piece's attention: a value the engine passes (never read from
/// the environment), so one process can run both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillKernel {
    /// f32 products throughout (attention.wgsl OP=prefill): every adapter and cache type.
    Tiled,
    /// Cooperative-matrix tiles (attention_coop.wgsl): f16 q, K, V and weights into f32
    /// accumulators, as llama.cpp's tensor-core flash attention; an f16 cache only.
    Coop,
}

/// The kernel a prefill piece of `shape` runs with `precision`: the cooperative one for the fast
/// default over an f16 cache where the adapter has it ([`coop_prefill_fits`]), else the tiled one
/// (the precise setting keeps f32 products, as it does for the mat-mats).
pub fn prefill_kernel(gpu: &Gpu, shape: &AttnShape, precision: Precision) -> PrefillKernel {
    if precision == Precision::Fast && coop_prefill_fits(gpu, shape) {
        PrefillKernel::Coop
    } else {
        PrefillKernel::Tiled
    }
}

/// Whether [`PrefillKernel::Coop`] can run `shape` here: f16 K and V, head dims in 32-wide halves,
/// a GQA group within one 64-row tile, F×F×F f16→f32 cooperative matrices
/// ([`matmul::coop_fragment`]), and room for its workgroup (8 subgroups, at least one invocation
/// per row of the tile) and its workgroup memory.
pub fn coop_prefill_fits(gpu: &Gpu, shape: &AttnShape) -> bool {
    let hd = u64::from(shape.head_dim);
    let rows = u64::from(PREFILL_ROWS);
    let keys = u64::from(COOP_KEYS);
    let threads = COOP_SUBGROUPS * gpu.caps.subgroup_max_size;
    let parts = u64::from(threads / PREFILL_ROWS);
    // Staged q half or K/V block (f16), scores (f32), weights (f16), row maxima per part and the
    // rows' maxima, the tile.
    let bytes =
        2 * rows * (hd / 2 + 8) + 4 * keys * rows + 2 * rows * (keys + 8) + 4 * (parts + 1) * rows + 16;
    shape.k_type == KvType::F16
        && shape.v_type == KvType::F16
        && shape.head_dim.is_multiple_of(32)
        && shape.group() <= PREFILL_ROWS
        && matmul::coop_fragment(gpu, wgpu::CooperativeScalarType::F32).is_some()
        && threads <= gpu.caps.max_invocations
        && threads.is_multiple_of(PREFILL_ROWS)
        && COOP_KEYS.is_multiple_of(threads / PREFILL_ROWS)
        && bytes <= u64::from(gpu.caps.max_workgroup_storage)
}

/// Largest GQA group and head dim the kernels keep in registers.
pub const MAX_GROUP: u32 = 16;
pub const MAX_HEAD_DIM: u32 = 512;

/// Element type of a KV cache tensor. f16 is the default (what llama.cpp keeps); f32 is the precise
/// setting; q8_0 (K only) is blocks of 32 int8 with one f16 scale, as ggml's Q8_0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvType {
    F32,
    F16,
    Q8_0,
}

impl KvType {
    pub fn parse(name: &str) -> Result<KvType> {
        match name.to_ascii_lowercase().as_str() {
            "f32" => Ok(KvType::F32),
            "f16" => Ok(KvType::F16),
            "q8_0" => Ok(KvType::Q8_0),
            other => Err(QkError::Engine(format!(
                "KV cache type {other:?}: expected f16, q8_0 or f32"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::Q8_0 => "q8_0",
        }
    }

    /// Words of one (position, kv head) row of `head_dim` values: f32s, f16 pairs, or q8_0's
    /// int8 quads followed by the f16 block scales two per word.
    pub fn row_words(self, head_dim: u32) -> u32 {
        match self {
            KvType::F32 => head_dim,
            KvType::F16 => head_dim / 2,
            KvType::Q8_0 => head_dim / 4 + (head_dim / 32).div_ceil(2),
        }
    }

    fn define(self) -> String {
        match self {
            KvType::F32 => "0",
            KvType::F16 => "1",
            KvType::Q8_0 => "2",
        }
        .into()
    }

    /// Head dims must fill the kernels' 8-dim units (and q8_0's 32-value blocks).
    fn fits(self, head_dim: u32) -> bool {
        let unit = if self == KvType::Q8_0 { 32 } else { 8 };
        head_dim > 0 && head_dim.is_multiple_of(unit)
    }
}

/// The shape of one model's attention and its cache.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnShape {
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub n_rot: u32,
    /// Positions per slot in the cache.
    pub ctx: u32,
    pub k_type: KvType,
    pub v_type: KvType,
    /// Softmax scale of q·k.
    pub scale: f32,
    /// RMSNorm epsilon of the q/k norms.
    pub eps: f32,
}

impl AttnShape {
    pub fn group(&self) -> u32 {
        self.heads / self.kv_heads.max(1)
    }

    /// Bytes of one position's K (all kv heads) and V.
    pub fn k_position_bytes(&self) -> u64 {
        4 * u64::from(self.kv_heads) * u64::from(self.k_type.row_words(self.head_dim))
    }

    pub fn v_position_bytes(&self) -> u64 {
        4 * u64::from(self.kv_heads) * u64::from(self.v_type.row_words(self.head_dim))
    }

    /// K plus V bytes of one slot of one layer.
    pub fn slot_bytes(&self) -> u64 {
        u64::from(self.ctx) * (self.k_position_bytes() + self.v_position_bytes())
    }

    /// Checks the shape against what the kernels handle; a typed error names the problem.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(QkError::Engine(format!("attention: {msg}")));
        if self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) || self.group() > MAX_GROUP {
            return bad(format!(
                "{} q heads over {} kv heads (groups up to {MAX_GROUP})",
                self.heads, self.kv_heads
            ));
        }
        if self.head_dim > MAX_HEAD_DIM
            || !self.k_type.fits(self.head_dim)
            || !self.v_type.fits(self.head_dim)
        {
            return bad(format!(
                "head_dim {} does not suit a {} K / {} V cache (multiples of 8, of 32 for q8_0, up to {MAX_HEAD_DIM})",
                self.head_dim,
                self.k_type.name(),
                self.v_type.name()
            ));
        }
        if self.v_type == KvType::Q8_0 {
            return bad("a q8_0 V cache is not supported (K only): use f16 or f32".into());
        }
        if self.n_rot == 0 || !self.n_rot.is_multiple_of(2) || self.n_rot > self.head_dim {
            return bad(format!("n_rot {} must be even and fit head_dim", self.n_rot));
        }
        if self.ctx == 0 {
            return bad("ctx must be at least 1".into());
        }
        Ok(())
    }

    /// Slots one pair of K/V buffers holds: as many as fit the device's largest binding and buffer.
    pub fn slots_per_buffer(&self, max_binding: u64, max_buffer: u64) -> Result<u32> {
        let ctx = u64::from(self.ctx);
        let per_slot = ctx * self.k_position_bytes().max(self.v_position_bytes());
        let limit = max_binding.min(max_buffer);
        crate::ensure!(
            per_slot <= limit,
            QkError::OutOfMemory(format!(
                "KV cache: ctx {} needs {per_slot} bytes per slot and tensor, more than one binding ({limit})",
                self.ctx
            ))
        );
        // Word indices stay below 2^32 (the kernels index in u32).
        Ok((limit.min(1 << 34) / per_slot).min(u64::from(u32::MAX)) as u32)
    }
}

/// One K/V buffer pair of a layer, holding slots `first_slot .. first_slot + slots`.
#[derive(Clone, Copy, Debug)]
pub struct KvGroup<'a> {
    pub k: &'a GpuBuffer,
    pub v: &'a GpuBuffer,
    pub first_slot: u32,
    pub slots: u32,
}

/// Where the rows of a prepare dispatch come from.
#[derive(Clone, Copy, Debug)]
pub enum AttnRows<'a> {
    /// A decode step: `n` rows, `[slot, pos]` pairs in `buf`.
    Step { buf: &'a GpuBuffer, n: u32 },
    /// A prefill piece: positions `pos .. pos + n` of `slot`.
    Piece { slot: u32, pos: u32, n: u32 },
}

impl AttnRows<'_> {
    pub fn n(&self) -> u32 {
        match *self {
            AttnRows::Step { n, .. } | AttnRows::Piece { n, .. } => n,
        }
    }
}

/// Where q, K and V sit in the projection output (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProjLayout {
    pub row_stride: u32,
    pub q_offset: u32,
    pub q_head_stride: u32,
    pub k_offset: u32,
    pub v_offset: u32,
}

pub struct PrepareArgs<'a> {
    pub proj: &'a GpuBuffer,
    pub layout: ProjLayout,
    pub q_norm: &'a GpuBuffer,
    pub k_norm: &'a GpuBuffer,
    /// RoPE frequencies from [`super::rope::freq_table`].
    pub freqs: &'a GpuBuffer,
    /// Prepared q, packed rows of heads × head_dim.
    pub q_out: &'a GpuBuffer,
}

/// Gate logits of (row r, head h, dim d) at `offset + r * row_stride + h * head_stride + d`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GateLayout {
    pub offset: u32,
    pub row_stride: u32,
    pub head_stride: u32,
}

/// Output of (row r, head h) at `offset + r * row_stride + h * head_dim`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutLayout {
    pub offset: u32,
    pub row_stride: u32,
}

pub struct CoreArgs<'a> {
    /// Prepared q (packed rows of heads × head_dim, as [`record_prepare`] writes it).
    pub q: &'a GpuBuffer,
    /// The sigmoid gate's logits, or None for plain attention.
    pub gate: Option<(&'a GpuBuffer, GateLayout)>,
    pub out: &'a GpuBuffer,
    pub out_layout: OutLayout,
    /// Scratch of [`partial_len`] f32s each.
    pub part_o: &'a GpuBuffer,
    pub part_ml: &'a GpuBuffer,
}

/// f32 counts of the partial-output and (max, sum) scratch for decode steps of up to
/// `decode_rows` rows and prefill pieces of up to `prefill_rows` positions.
pub fn partial_len(decode_rows: u32, prefill_rows: u32, heads: u32, head_dim: u32) -> (u64, u64) {
    let per_head = (u64::from(decode_rows) * u64::from(DECODE_MAX_SPLITS))
        .max(u64::from(prefill_rows) * u64::from(PREFILL_MAX_SPLITS));
    let entries = per_head * u64::from(heads);
    (entries * u64::from(head_dim), entries * 2)
}

/// (keys per split, splits) of a row (or prefill tile) over `n` keys: the shortest power-of-two
/// multiple of `min_split` that needs at most `max_splits` splits. Mirrors `plan` in
/// common_attention.wgsl; a row's plan depends on its own key count only, so its bytes do not depend on
/// which other rows share the dispatch.
pub fn split_plan(n: u32, min_split: u32, max_splits: u32) -> (u32, u32) {
    let mut len = min_split;
    while u64::from(len) * u64::from(max_splits) < u64::from(n) {
        len *= 2;
    }
    (len, n.div_ceil(len))
}

crate::gpu_params! {
    /// The immediates of the attention core and merge passes (attention.wgsl, attention_coop.wgsl;
    /// `#params CoreParams` in common_attention.wgsl).
    struct CoreParams {
        /// Rows of the dispatch; with rows_from_buffer = 0 row r is (slot, pos + r).
        rows: u32,
        rows_from_buffer: u32,
        slot: u32,
        pos: u32,
        heads: u32,
        kv_heads: u32,
        /// Positions per slot in the cache, and the slots [first_slot, first_slot + slots) it holds.
        ctx: u32,
        first_slot: u32,
        slots: u32,
        /// Prepared q (f32): row r head h at q_offset + r * q_row_stride + h * HEAD_DIM.
        q_offset: u32,
        q_row_stride: u32,
        /// Gate logits (merge): row r head h dim d at gate_offset + r * gate_row_stride + h * gate_head_stride + d.
        gate_offset: u32,
        gate_row_stride: u32,
        gate_head_stride: u32,
        gated: u32,
        /// Output: row r head h at out_offset + r * out_row_stride + h * HEAD_DIM.
        out_offset: u32,
        out_row_stride: u32,
        /// Partial entries per (row, head), and the split plan.
        split_stride: u32,
        min_split: u32,
        max_splits: u32,
        /// Rows per query tile (prefill TT; decode 1): the merge recomputes its tile's plan.
        tile_rows: u32,
        scale: f32,
    }
}

crate::gpu_params! {
    /// The immediates of attention.wgsl's prepare pass (q/k norm, RoPE, KV store).
    struct PrepareParams {
        /// Rows of the dispatch; with rows_from_buffer = 0 row r is (slot, pos + r).
        rows: u32,
        rows_from_buffer: u32,
        slot: u32,
        pos: u32,
        heads: u32,
        kv_heads: u32,
        n_rot: u32,
        ctx: u32,
        first_slot: u32,
        slots: u32,
        /// Projection row r: q head h at r * proj_row_stride + q_offset + h * q_head_stride, kv head g's
        /// K at ... + k_offset + g * HEAD_DIM, V at ... + v_offset + g * HEAD_DIM.
        proj_row_stride: u32,
        q_offset: u32,
        q_head_stride: u32,
        k_offset: u32,
        v_offset: u32,
        /// Prepared q: row r head h at q_out_offset + r * q_out_row_stride + h * HEAD_DIM.
        q_out_offset: u32,
        q_out_row_stride: u32,
        eps: f32,
    }
}

/// Invocations sharing one key (decode) or one query row (prefill): a power of two dividing the
/// subgroup size and the head's 8-dim units; 1 without subgroups.
fn lanes(gpu: &Gpu, head_dim: u32, most: u32) -> u32 {
    if !gpu.caps.subgroups {
        return 1;
    }
    let units = head_dim / 8;
    let mut l = most.min(gpu.caps.subgroup_min_size.max(1));
    while l > 1 && !(units.is_multiple_of(l) && l.is_power_of_two()) {
        l /= 2;
    }
    l.max(1)
}

fn kernel_defines(shape: &AttnShape, op: &str, lanes: u32, wg: u32) -> [(&'static str, String); 13] {
    tuned_defines(shape, op, lanes, wg, DecodeTuning::DEFAULT)
}

fn tuned_defines(
    shape: &AttnShape,
    op: &str,
    lanes: u32,
    wg: u32,
    tuning: DecodeTuning,
) -> [(&'static str, String); 13] {
    [
        ("OP", op.into()),
        ("K_TYPE", shape.k_type.define()),
        ("V_TYPE", shape.v_type.define()),
        ("HEAD_DIM", shape.head_dim.to_string()),
        ("GROUP", shape.group().to_string()),
        ("LANES", lanes.to_string()),
        ("UPL", (shape.head_dim / 8 / lanes).to_string()),
        ("COLS", tuning.cols.to_string()),
        ("UNROLL", tuning.unroll.to_string()),
        ("PR", PREFILL_ROWS.to_string()),
        ("BK", PREFILL_KEYS.to_string()),
        ("WG", wg.to_string()),
        (
            "MAX_SPLITS",
            DECODE_MAX_SPLITS.max(PREFILL_MAX_SPLITS).to_string(),
        ),
    ]
}

/// Workgroup memory of the decode kernel (q of the group, the column merge) and of the prefill
/// kernel (one staged K or V block), checked against the device before the pipeline is built.
fn check_workgroup_memory(gpu: &Gpu, shape: &AttnShape, decode: Option<DecodeTuning>) -> Result<()> {
    let unit_bytes = 32 * u64::from(shape.head_dim / 8);
    let bytes = if let Some(t) = decode {
        unit_bytes * u64::from(shape.group() + t.cols) + 8 * u64::from(t.cols)
    } else {
        unit_bytes * u64::from(PREFILL_KEYS)
    };
    crate::ensure!(
        bytes <= u64::from(gpu.caps.max_workgroup_storage),
        QkError::Engine(format!(
            "attention: {} q heads per kv head of dim {} need {bytes} bytes of workgroup memory, the device has {}",
            shape.group(),
            shape.head_dim,
            gpu.caps.max_workgroup_storage
        ))
    );
    Ok(())
}

fn check_groups(shape: &AttnShape, kv: &[KvGroup<'_>]) -> Result<()> {
    crate::ensure!(!kv.is_empty(), QkError::Engine("attention: no KV buffers".into()));
    let cells = |slots: u32| u64::from(slots) * u64::from(shape.ctx) * u64::from(shape.kv_heads);
    for g in kv {
        let kw = cells(g.slots) * u64::from(shape.k_type.row_words(shape.head_dim));
        let vw = cells(g.slots) * u64::from(shape.v_type.row_words(shape.head_dim));
        require_len("attention k cache", g.k, kw)?;
        require_len("attention v cache", g.v, vw)?;
    }
    Ok(())
}

/// The rows binding, whether the rows come from it, and (slot, pos) for a piece. A piece binds
/// `placeholder` (one of the kernel's read-only inputs, never read there) in the rows slot.
fn rows_source<'a>(rows: AttnRows<'a>, placeholder: &'a GpuBuffer) -> Result<(&'a GpuBuffer, u32, u32, u32)> {
    match rows {
        AttnRows::Step { buf, n } => {
            require_len("attention rows", buf, 2 * u64::from(n))?;
            Ok((buf, 1, 0, 0))
        }
        AttnRows::Piece { slot, pos, .. } => Ok((placeholder, 0, slot, pos)),
    }
}

/// The group holding `slot` (a piece's slot must be in one).
fn group_of<'g, 'a>(kv: &'g [KvGroup<'a>], slot: u32) -> Result<&'g KvGroup<'a>> {
    kv.iter()
        .find(|g| slot >= g.first_slot && slot - g.first_slot < g.slots)
        .ok_or_else(|| QkError::Engine(format!("attention: slot {slot} is in no KV buffer")))
}

/// Record the prepare op for `rows` (see the module doc). Positions are checked against `ctx` for
/// a piece; a step's rows are the caller's (the engine checks them before writing the buffer).
pub fn record_prepare(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    shape: &AttnShape,
    rows: AttnRows<'_>,
    kv: &[KvGroup<'_>],
    args: &PrepareArgs<'_>,
) -> Result<()> {
    shape.validate()?;
    check_groups(shape, kv)?;
    let n = rows.n();
    if n == 0 {
        return Ok(());
    }
    let l = args.layout;
    let hd = u64::from(shape.head_dim);
    let last = u64::from(n - 1) * u64::from(l.row_stride);
    require_len(
        "attention projection",
        args.proj,
        last + (u64::from(l.q_offset) + u64::from(shape.heads - 1) * u64::from(l.q_head_stride) + hd)
            .max(u64::from(l.k_offset.max(l.v_offset)) + u64::from(shape.kv_heads) * hd),
    )?;
    require_len("attention q_norm", args.q_norm, hd)?;
    require_len("attention k_norm", args.k_norm, hd)?;
    require_len("attention rope freqs", args.freqs, u64::from(shape.n_rot / 2))?;
    require_len(
        "attention q out",
        args.q_out,
        u64::from(n) * u64::from(shape.heads) * hd,
    )?;
    let (rows_buf, from_buffer, slot, pos) = rows_source(rows, args.proj)?;
    let groups: Vec<&KvGroup<'_>> = match rows {
        AttnRows::Step { .. } => kv.iter().collect(),
        AttnRows::Piece { slot, pos, n } => {
            crate::ensure!(
                u64::from(pos) + u64::from(n) <= u64::from(shape.ctx),
                QkError::Engine(format!(
                    "attention: positions {pos}..{} beyond ctx {}",
                    u64::from(pos) + u64::from(n),
                    shape.ctx
                ))
            );
            vec![group_of(kv, slot)?]
        }
    };
    let pipe = gpu.pipeline(&FILE, &kernel_defines(shape, "prepare", 1, 64), &[])?;
    for g in groups {
        let p = PrepareParams {
            rows: n,
            rows_from_buffer: from_buffer,
            slot,
            pos,
            heads: shape.heads,
            kv_heads: shape.kv_heads,
            n_rot: shape.n_rot,
            ctx: shape.ctx,
            first_slot: g.first_slot,
            slots: g.slots,
            proj_row_stride: l.row_stride,
            q_offset: l.q_offset,
            q_head_stride: l.q_head_stride,
            k_offset: l.k_offset,
            v_offset: l.v_offset,
            q_out_offset: 0,
            q_out_row_stride: shape.heads * shape.head_dim,
            eps: shape.eps,
        };
        rec.dispatch(
            &pipe,
            &[
                rows_buf.all(),
                args.proj.all(),
                args.q_norm.all(),
                args.k_norm.all(),
                args.freqs.all(),
                args.q_out.all(),
                g.k.all(),
                g.v.all(),
            ],
            bytemuck::bytes_of(&p),
            [shape.heads + shape.kv_heads, n, 1],
        )?;
    }
    Ok(())
}

fn check_core(
    shape: &AttnShape,
    n: u32,
    decode: bool,
    kv: &[KvGroup<'_>],
    args: &CoreArgs<'_>,
) -> Result<()> {
    shape.validate()?;
    check_groups(shape, kv)?;
    let hd = u64::from(shape.head_dim);
    let heads = u64::from(shape.heads);
    require_len("attention q", args.q, u64::from(n) * heads * hd)?;
    let last = u64::from(n.max(1) - 1);
    if let Some((gate, gl)) = args.gate {
        require_len(
            "attention gate",
            gate,
            u64::from(gl.offset)
                + last * u64::from(gl.row_stride)
                + (heads - 1) * u64::from(gl.head_stride)
                + hd,
        )?;
    }
    let o = args.out_layout;
    require_len(
        "attention out",
        args.out,
        u64::from(o.offset) + last * u64::from(o.row_stride) + heads * hd,
    )?;
    let (po, pml) = if decode {
        partial_len(n, 0, shape.heads, shape.head_dim)
    } else {
        partial_len(0, n, shape.heads, shape.head_dim)
    };
    require_len("attention partial out", args.part_o, po)?;
    require_len("attention partial max/sum", args.part_ml, pml)
}

fn core_params(shape: &AttnShape, n: u32, args: &CoreArgs<'_>) -> CoreParams {
    let (gate_offset, gate_row_stride, gate_head_stride) = args
        .gate
        .map_or((0, 0, 0), |(_, g)| (g.offset, g.row_stride, g.head_stride));
    CoreParams {
        rows: n,
        heads: shape.heads,
        kv_heads: shape.kv_heads,
        ctx: shape.ctx,
        q_offset: 0,
        q_row_stride: shape.heads * shape.head_dim,
        gate_offset,
        gate_row_stride,
        gate_head_stride,
        gated: u32::from(args.gate.is_some()),
        out_offset: args.out_layout.offset,
        out_row_stride: args.out_layout.row_stride,
        tile_rows: 1,
        scale: shape.scale,
        ..Default::default()
    }
}

/// One split dispatch (decode or prefill) over the cache buffers `g`.
fn dispatch_core(
    rec: &mut Recorder<'_>,
    pipe: &Pipeline,
    p: &CoreParams,
    rows_buf: &GpuBuffer,
    g: &KvGroup<'_>,
    args: &CoreArgs<'_>,
    grid: [u32; 3],
) -> Result<()> {
    rec.dispatch(
        pipe,
        &[
            rows_buf.all(),
            args.q.all(),
            g.k.all(),
            g.v.all(),
            args.part_o.all(),
            args.part_ml.all(),
        ],
        bytemuck::bytes_of(p),
        grid,
    )
}

fn record_merge(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    shape: &AttnShape,
    p: &CoreParams,
    rows_buf: &GpuBuffer,
    args: &CoreArgs<'_>,
) -> Result<()> {
    let pipe = gpu.pipeline(&FILE, &kernel_defines(shape, "merge", 1, MERGE_WG), &[])?;
    let gate = args.gate.map_or(args.q, |(g, _)| g);
    rec.dispatch(
        &pipe,
        &[
            rows_buf.all(),
            gate.all(),
            args.part_o.all(),
            args.part_ml.all(),
            args.out.all(),
        ],
        bytemuck::bytes_of(p),
        [shape.heads, p.rows, 1],
    )
}

/// Record decode attention over the `n` rows of `rows_buf` (a step: `[slot, pos]` pairs, K/V of
/// each row's own position already stored by [`record_prepare`]): one split dispatch per buffer
/// group, sized for `shape.ctx` (splits past a row's keys exit at once), then the merge. `walk`:
/// how the split kernel walks the keys ([`DecodeTuning::DEFAULT`], the engine's `attention_walk`,
/// or a tuning run's).
#[allow(clippy::too_many_arguments)]
pub fn record_decode(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    shape: &AttnShape,
    rows_buf: &GpuBuffer,
    n: u32,
    kv: &[KvGroup<'_>],
    args: &CoreArgs<'_>,
    walk: DecodeTuning,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    walk.check()?;
    check_core(shape, n, true, kv, args)?;
    check_workgroup_memory(gpu, shape, Some(walk))?;
    require_len("attention rows", rows_buf, 2 * u64::from(n))?;
    let lanes = lanes(gpu, shape.head_dim, walk.lanes);
    crate::ensure!(
        walk.cols * lanes <= gpu.caps.max_invocations,
        QkError::Engine(format!(
            "attention walk: {} columns of {lanes} lanes exceed the device's {} invocations per workgroup",
            walk.cols, gpu.caps.max_invocations
        ))
    );
    let pipe = gpu.pipeline(
        &FILE,
        &tuned_defines(shape, "decode", lanes, walk.cols * lanes, walk),
        &[],
    )?;
    let mut p = CoreParams {
        rows_from_buffer: 1,
        split_stride: DECODE_MAX_SPLITS,
        min_split: walk.min_split,
        max_splits: DECODE_MAX_SPLITS,
        ..core_params(shape, n, args)
    };
    let splits = split_plan(shape.ctx, walk.min_split, DECODE_MAX_SPLITS).1;
    for g in kv {
        p.first_slot = g.first_slot;
        p.slots = g.slots;
        dispatch_core(rec, &pipe, &p, rows_buf, g, args, [splits, shape.kv_heads, n])?;
    }
    record_merge(gpu, rec, shape, &p, rows_buf, args)
}

/// Record prefill attention for positions `pos .. pos + n` of `slot` (prepared by
/// [`record_prepare`] with a piece) with `kernel`: tiles of query rows over the cache, then the
/// merge. Both kernels write the same partials for the same tiles and split plan.
#[allow(clippy::too_many_arguments)]
pub fn record_prefill(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    shape: &AttnShape,
    slot: u32,
    pos: u32,
    n: u32,
    kv: &[KvGroup<'_>],
    args: &CoreArgs<'_>,
    kernel: PrefillKernel,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    check_core(shape, n, false, kv, args)?;
    crate::ensure!(
        u64::from(pos) + u64::from(n) <= u64::from(shape.ctx),
        QkError::Engine(format!(
            "attention: positions {pos}..+{n} beyond ctx {}",
            shape.ctx
        ))
    );
    let g = group_of(kv, slot)?;
    let tokens_per_tile = PREFILL_ROWS / shape.group();
    let p = CoreParams {
        slot,
        pos,
        first_slot: g.first_slot,
        slots: g.slots,
        split_stride: PREFILL_MAX_SPLITS,
        min_split: PREFILL_MIN_SPLIT,
        max_splits: PREFILL_MAX_SPLITS,
        tile_rows: tokens_per_tile,
        ..core_params(shape, n, args)
    };
    let splits = split_plan(pos + n, PREFILL_MIN_SPLIT, PREFILL_MAX_SPLITS).1;
    let grid = [splits, shape.kv_heads, n.div_ceil(tokens_per_tile)];
    let pipe = match kernel {
        PrefillKernel::Tiled => {
            check_workgroup_memory(gpu, shape, None)?;
            let lanes = lanes(gpu, shape.head_dim, 4);
            gpu.pipeline(
                &FILE,
                &kernel_defines(shape, "prefill", lanes, PREFILL_ROWS * lanes),
                &[],
            )?
        }
        PrefillKernel::Coop => {
            crate::ensure!(
                coop_prefill_fits(gpu, shape),
                QkError::Engine(format!(
                    "attention: the cooperative prefill kernel cannot run {}x{} heads of dim {} over a {}/{} cache on {}",
                    shape.heads,
                    shape.kv_heads,
                    shape.head_dim,
                    shape.k_type.name(),
                    shape.v_type.name(),
                    gpu.adapter.name
                ))
            );
            let f = matmul::coop_fragment(gpu, wgpu::CooperativeScalarType::F32).unwrap_or(16);
            gpu.pipeline(
                &COOP_FILE,
                &[
                    ("HEAD_DIM", shape.head_dim.to_string()),
                    ("GROUP", shape.group().to_string()),
                    ("SG", gpu.caps.subgroup_max_size.to_string()),
                    ("F", f.to_string()),
                    ("R", (16 / f).to_string()),
                    ("DF", (shape.head_dim / 2 / f).to_string()),
                    ("KB", (COOP_KEYS / f).to_string()),
                ],
                &[],
            )?
        }
    };
    // The rows binding is unused by a piece: bind q (read-only here).
    dispatch_core(rec, &pipe, &p, args.q, g, args, grid)?;
    record_merge(gpu, rec, shape, &p, args.q, args)
}

pub mod reference {
    //! CPU references: the prepare op (f64 norms and rotation, then the cache type's rounding) and
    //! attention in f64 over cache rows decoded to f32.

    use half::f16;

    use super::{AttnShape, KvType};

    /// RMSNorm with weight `w` then RoPE at `pos`, in f64, of one head row.
    pub fn norm_rope(x: &[f32], w: &[f32], eps: f32, n_rot: u32, pos: u32, freqs: &[f32]) -> Vec<f64> {
        let n = x.len() as f64;
        let sq: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let inv = 1.0 / (sq / n + f64::from(eps)).sqrt();
        let mut y: Vec<f64> = x
            .iter()
            .zip(w)
            .map(|(&v, &w)| f64::from(v) * inv * f64::from(w))
            .collect();
        crate::ops::rope::reference::rotate(&mut y, n_rot, pos, freqs);
        y
    }

    /// The cache words of one row of `values` in type `ty` (q8_0 as ggml: d = amax/127 rounded to
    /// f16 for storage, quants rounded half to even as the shader's `round`).
    pub fn encode_row(ty: KvType, values: &[f32]) -> Vec<u32> {
        match ty {
            KvType::F32 => values.iter().map(|v| v.to_bits()).collect(),
            KvType::F16 => values
                .chunks(2)
                .map(|p| {
                    u32::from(f16::from_f32(p[0]).to_bits())
                        | (u32::from(f16::from_f32(p[1]).to_bits()) << 16)
                })
                .collect(),
            KvType::Q8_0 => {
                let d_len = values.len();
                let scales: Vec<f32> = values
                    .chunks(32)
                    .map(|b| b.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0)
                    .collect();
                let mut out: Vec<u32> = values
                    .chunks(4)
                    .enumerate()
                    .map(|(w, quad)| {
                        let d = scales[w / 8];
                        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                        quad.iter()
                            .enumerate()
                            .map(|(i, v)| (((v * id).round_ties_even() as i32 as u8) as u32) << (8 * i))
                            .sum()
                    })
                    .collect();
                for pair in scales.chunks(2) {
                    let lo = f16::from_f32(pair[0]).to_bits();
                    let hi = pair.get(1).map_or(0, |s| f16::from_f32(*s).to_bits());
                    out.push(u32::from(lo) | (u32::from(hi) << 16));
                }
                debug_assert_eq!(out.len() as u32, ty.row_words(d_len as u32));
                out
            }
        }
    }

    /// The `head_dim` values of one cache row of type `ty`.
    pub fn decode_row(ty: KvType, words: &[u32], head_dim: usize) -> Vec<f32> {
        match ty {
            KvType::F32 => words[..head_dim].iter().map(|w| f32::from_bits(*w)).collect(),
            KvType::F16 => words[..head_dim / 2]
                .iter()
                .flat_map(|w| {
                    [
                        f16::from_bits(*w as u16).to_f32(),
                        f16::from_bits((*w >> 16) as u16).to_f32(),
                    ]
                })
                .collect(),
            KvType::Q8_0 => (0..head_dim)
                .map(|i| {
                    let b = i / 32;
                    let sw = words[head_dim / 4 + b / 2];
                    let d = f16::from_bits((sw >> (16 * (b % 2))) as u16).to_f32();
                    let q = (words[i / 4] >> (8 * (i % 4))) as u8 as i8;
                    f32::from(q) * d
                })
                .collect(),
        }
    }

    /// Gated attention of one row in f64: `q` (heads × head_dim, unscaled) over keys `0..n`,
    /// `k(p, g)` / `v(p, g)` the decoded cache rows; `gate` (heads × head_dim) or None.
    pub fn attention_row(
        shape: &AttnShape,
        q: &[f32],
        gate: Option<&[f32]>,
        n: usize,
        k: &dyn Fn(usize, usize) -> Vec<f32>,
        v: &dyn Fn(usize, usize) -> Vec<f32>,
    ) -> Vec<f32> {
        let hd = shape.head_dim as usize;
        let group = shape.group() as usize;
        let mut out = vec![0f32; shape.heads as usize * hd];
        for h in 0..shape.heads as usize {
            let g = h / group;
            let qh = &q[h * hd..(h + 1) * hd];
            let scores: Vec<f64> = (0..n)
                .map(|p| {
                    let kr = k(p, g);
                    qh.iter()
                        .zip(&kr)
                        .map(|(a, b)| f64::from(*a) * f64::from(*b))
                        .sum::<f64>()
                        * f64::from(shape.scale)
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let l: f64 = e.iter().sum();
            let mut o = vec![0f64; hd];
            for (p, ep) in e.iter().enumerate() {
                for (od, vd) in o.iter_mut().zip(v(p, g)) {
                    *od += ep * f64::from(vd);
                }
            }
            for d in 0..hd {
                let gf = gate.map_or(1.0, |z| 1.0 / (1.0 + (-f64::from(z[h * hd + d])).exp()));
                out[h * hd + d] = (o[d] / l * gf) as f32;
            }
        }
        out
    }
}
