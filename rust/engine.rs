//! The engine: a model's layer range on one GPU with independent slots (KV, conv and DeltaNet
//! state each), `stage_run` for positions of one slot, `step` for one decode position of several
//! slots in one pass, state snapshots, and counters. No I/O beyond loading, no Python.
//!
//! Prefill is cut internally into pieces of up to `prefill_rows` positions (512 or 2048 by default)
//! at absolute multiples of 64 (the DeltaNet chunk; `piece_len`), so a prompt gives the same bytes
//! however it is cut into calls at multiples of 64 and whatever the piece size; each piece is one
//! recorded command sequence (submitted in parts while it is recorded) and one readback.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use crate::error::{QkError, Result};
use crate::gguf::GgufFile;
use crate::gpu::armed::ArmedInputs;
use crate::gpu::record::{Encoded, OpLabel, SubmitProfile, Submitted};
use crate::gpu::{CounterSnapshot, Gpu, GpuBuffer, GpuOptions, Recorder};
use crate::model::decode::{EXPERT_DECODE_OPS, SHAPED_DECODE_OPS};
use crate::model::forward::{Batch, Model, Scratch, SlotState, write_step_rows};
use crate::model::kv::attn_shape;
use crate::model::weights::{DeltaNetProjection, Mixer, Weights};
use crate::model::{LayerKind, ModelConfig};
use crate::ops::attention::{DecodeTuning, KvType};
use crate::ops::deltanet::CHUNK;
use crate::ops::embed::Ids;
use crate::ops::matmul::{
    ColumnClass, DENSE_GROUP_COLS, MATVEC_MAX_COLS, MatvecShape, Precision, column_class,
};
use crate::ops::rope::freq_table;
use crate::ops::topk::{IdLogit, MAX_K};

/// Input rows of a call: token ids (first stage) or hidden rows of n_embd f32 (later stages).
pub enum StageInput<'a> {
    Tokens(&'a [u32]),
    Hidden(&'a [f32]),
}

impl StageInput<'_> {
    fn len(&self, n_embd: u32) -> usize {
        match self {
            StageInput::Tokens(t) => t.len(),
            StageInput::Hidden(h) => h.len() / n_embd as usize,
        }
    }
}

/// What a stage returns for its rows.
#[derive(Debug, Clone, PartialEq)]
pub enum StageOutput {
    /// Hidden rows [n, n_embd] (a stage that does not own the LM head).
    Hidden(Vec<f32>),
    /// Greedy id of every position, and the top-k (id, logit) of the final position.
    Ids { ids: Vec<u32>, topk: Vec<(u32, f32)> },
}

/// A saved slot state (KV rows up to `pos`, conv rows, S), packed back to back in one buffer in
/// the order of [`state_parts`] (one allocation per save, not two per layer).
struct Snapshot {
    pos: u32,
    buffer: GpuBuffer,
}

/// The slot's state ranges (buffer, byte offset, bytes) a snapshot at `pos` holds, in layer order:
/// its KV cells of positions `0..pos` (their bytes depend on the cache types), conv rows and S.
fn state_parts<'a>(st: &'a SlotState, cfg: &ModelConfig, pos: u32) -> Result<Vec<(&'a GpuBuffer, u64, u64)>> {
    let mut parts = Vec::new();
    for l in &st.layers {
        parts.extend(l.parts(cfg, pos)?);
    }
    Ok(parts)
}

/// Device memory held, in bytes.
#[derive(Clone, Copy, Debug, Default)]
pub struct Memory {
    pub weights: u64,
    pub kv_per_slot: u64,
    pub deltanet_per_slot: u64,
    pub scratch: u64,
    pub snapshots: u64,
    pub total: u64,
}

/// Host-side times of one decode step, always measured (two clock reads, nothing allocated).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTiming {
    /// Slots stepped (tokens produced).
    pub rows: u32,
    /// From the call to the encoded commands: checks, input upload, recording every dispatch
    /// and wgpu's validation and translation of the pass (host CPU).
    pub record_us: f64,
    /// `queue.submit` (host CPU: wgpu's submission work and the driver's).
    pub submit_us: f64,
    /// From the submit to the results on the host: GPU execution and the readback map.
    pub wait_us: f64,
    /// The whole call, including unpacking the results.
    pub total_us: f64,
    /// The step's commands had been recorded ahead, while the step before it ran.
    pub ahead: bool,
}

/// Every decode step's [`StepTiming`] summed since the engine was loaded: the means of a run are
/// the difference of two readings over its steps.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTotals {
    pub steps: u64,
    /// Steps whose commands had been recorded ahead.
    pub ahead: u64,
    pub rows: u64,
    pub record_us: f64,
    /// `record_us` of the steps recorded ahead alone: a step recorded on the spot (the first
    /// after a prefill) records all its commands, ms where an ahead step takes µs, so the mean
    /// over both says little about either.
    pub ahead_record_us: f64,
    pub submit_us: f64,
    pub wait_us: f64,
    pub total_us: f64,
}

impl StepTotals {
    fn add(&mut self, t: &StepTiming) {
        self.steps += 1;
        self.ahead += u64::from(t.ahead);
        self.rows += u64::from(t.rows);
        self.record_us += t.record_us;
        if t.ahead {
            self.ahead_record_us += t.record_us;
        }
        self.submit_us += t.submit_us;
        self.wait_us += t.wait_us;
        self.total_us += t.total_us;
    }
}

/// One op instance of a profiled step (or, aggregated over layers, one op family).
#[derive(Clone, Debug, PartialEq)]
pub struct OpProfile {
    pub op: &'static str,
    /// None for the embedding and head, and for a family aggregated over layers.
    pub layer: Option<u32>,
    /// Distinct kernels (pipeline labels) its dispatches used.
    pub kernels: Vec<String>,
    pub dispatches: u32,
    /// Sum of its dispatches' GPU times; None without timestamp queries.
    pub gpu_us: Option<f64>,
    /// Weight (and recurrent-state) bytes the op reads.
    pub bytes: u64,
}

impl OpProfile {
    /// Achieved bandwidth over the op's weight bytes (None without timestamps or bytes).
    pub fn gb_per_s(&self) -> Option<f64> {
        match self.gpu_us {
            Some(us) if us > 0.0 && self.bytes > 0 => Some(self.bytes as f64 / (us * 1e3)),
            _ => None,
        }
    }
}

/// A profiled decode step: every dispatch labelled and (where the adapter has timestamp queries)
/// timed on the GPU, the counters it moved, and host times. `normal` is the timing of the last
/// unprofiled step (profiling's pass per dispatch inflates the profiled step's own host times).
#[derive(Clone, Debug)]
pub struct StepProfile {
    pub rows: u32,
    pub submit: SubmitProfile,
    pub counters: CounterSnapshot,
    pub timing: StepTiming,
    pub normal: Option<StepTiming>,
}

impl StepProfile {
    /// One entry per op instance (layer and op), in recording order.
    pub fn ops(&self) -> Vec<OpProfile> {
        let timed = self.submit.timestamps;
        let mut out: Vec<(usize, OpProfile)> = Vec::new();
        for d in &self.submit.dispatches {
            if out.last().is_none_or(|(i, _)| *i != d.op_index) {
                out.push((d.op_index, empty_op(d.op, timed)));
            }
            if let Some((_, o)) = out.last_mut() {
                add_dispatch(o, &d.kernel, d.gpu_ns);
            }
        }
        out.into_iter().map(|(_, o)| o).collect()
    }

    /// Ops aggregated over layers by name, the most GPU time (or dispatches) first.
    pub fn families(&self) -> Vec<OpProfile> {
        let mut fams: Vec<OpProfile> = Vec::new();
        for o in self.ops() {
            let i = match fams.iter().position(|f| f.op == o.op) {
                Some(i) => i,
                None => {
                    let label = OpLabel {
                        op: o.op,
                        layer: None,
                        bytes: 0,
                    };
                    fams.push(empty_op(label, o.gpu_us.is_some()));
                    fams.len() - 1
                }
            };
            let f = &mut fams[i];
            f.dispatches += o.dispatches;
            f.bytes += o.bytes;
            f.gpu_us = f.gpu_us.zip(o.gpu_us).map(|(a, b)| a + b);
            for k in o.kernels {
                if !f.kernels.contains(&k) {
                    f.kernels.push(k);
                }
            }
        }
        fams.sort_by(|a, b| {
            b.gpu_us
                .unwrap_or(0.0)
                .total_cmp(&a.gpu_us.unwrap_or(0.0))
                .then(b.dispatches.cmp(&a.dispatches))
        });
        fams
    }

    /// Sum of every dispatch's GPU time (None without timestamps).
    pub fn gpu_busy_us(&self) -> Option<f64> {
        self.submit
            .dispatches
            .iter()
            .map(|d| d.gpu_ns)
            .sum::<Option<f64>>()
            .map(|ns| ns / 1e3)
    }
}

fn counter_delta(before: &CounterSnapshot, after: &CounterSnapshot) -> CounterSnapshot {
    CounterSnapshot {
        pipelines: after.pipelines - before.pipelines,
        bind_groups: after.bind_groups - before.bind_groups,
        buffers: after.buffers - before.buffers,
        submits: after.submits - before.submits,
        readbacks: after.readbacks - before.readbacks,
        dispatches: after.dispatches - before.dispatches,
        spun_waits: after.spun_waits - before.spun_waits,
        writes: after.writes - before.writes,
    }
}

fn empty_op(label: OpLabel, timed: bool) -> OpProfile {
    OpProfile {
        op: label.op,
        layer: label.layer,
        kernels: Vec::new(),
        dispatches: 0,
        gpu_us: timed.then_some(0.0),
        bytes: label.bytes,
    }
}

fn add_dispatch(o: &mut OpProfile, kernel: &str, gpu_ns: Option<f64>) {
    o.dispatches += 1;
    o.gpu_us = o.gpu_us.zip(gpu_ns).map(|(a, b)| a + b / 1e3);
    if !o.kernels.iter().any(|k| k == kernel) {
        o.kernels.push(kernel.to_string());
    }
}

/// Positions per prefill piece (one recorded submit) where the engine does not choose a larger one:
/// enough columns for the dense mat-mats to fill a GPU and to amortise each weight read, and a
/// multiple of the DeltaNet chunk. The scratch holds this many rows (its size is in
/// [`Engine::memory`] and the load line).
pub const PREFILL_PIECE: u32 = 512;

/// The default piece on a discrete GPU: a 512-row piece gives each of 512 experts only ~10 of its
/// entries, so the grouped MoE products dequantise every expert weight for a handful of columns;
/// at 2048 rows each expert has ~40 and a wide MoE tile reads its weights once for all of them.
/// The scratch grows with the piece (about 4× the 512-row one), so it is the default only where
/// the device is a discrete GPU and every scratch buffer fits its bindings and its memory; an
/// engine that must keep the scratch small passes `prefill_rows` explicitly.
pub const PREFILL_PIECE_LARGE: u32 = 2048;

/// Rows of logits the LM head computes at once within a prefill piece: a Qwen vocabulary makes a
/// row 0.6 MB, so a whole 512-row piece would need 311 MB (and more than lavapipe's 128 MiB
/// binding). One chunk, so each group is the same rows whatever the piece (like every other op).
const HEAD_ROWS: u32 = CHUNK;

/// Which rows of a prefill the LM head runs on (last stage).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HeadRows {
    /// Every row: the greedy id of each position ([`Engine::stage_run`]).
    All,
    /// The final position's head group only ([`Engine::stage_run_last`]).
    Last,
    /// Every row, one head group per piece, logits read back ([`Engine::logits`]).
    Logits,
}

/// One recorded pass of the forward: where its `n` rows come from, which layer path runs them and
/// what a last stage's head reads back. A prefill piece and a decode step are both recorded from
/// one ([`Engine::record_forward`]), so embed → layers → head → top-k → reads is written once (each
/// caller still checks its own arguments: a piece's slot and range, a step's slots).
struct ForwardPlan<'a> {
    feed: Feed,
    n: u32,
    layers: LayerRows<'a>,
    head: HeadPlan,
}

/// The layer path of a [`ForwardPlan`]'s rows.
enum LayerRows<'a> {
    /// One position of each slot: the fused decode layers (slot table and rows written already).
    Step {
        states: Vec<&'a SlotState>,
        positions: &'a [u32],
    },
    /// Positions `base..base + n` of one slot: a prefill piece.
    Piece { state: &'a SlotState, base: u32 },
}

/// What a last stage's head computes and reads back (a stage before it reads its hidden rows).
#[derive(Clone, Copy)]
enum HeadPlan {
    /// Every row's top `k`, one read per row (a decode step).
    EveryRow { k: u32 },
    /// A prefill piece: the greedy id of each row as `rows` asks, the final row's top `k`, and
    /// (HeadRows::Logits) the logits; `final_piece`: the call's last piece.
    Piece {
        k: u32,
        rows: HeadRows,
        final_piece: bool,
    },
}

/// The reads a recorded forward pass returns: `(ticket, k)` id batches in row order (k pairs a
/// row; a batch of k = 1 holds one pair per row), the hidden rows, the logits.
#[derive(Default)]
struct ForwardReads {
    ids: Vec<(usize, u32)>,
    hidden: Option<usize>,
    logits: Option<usize>,
}

/// Rows of the next prefill piece at absolute position `pos` with `left` rows to go, at most `max`
/// (a multiple of 64). A piece that starts mid-chunk ends at the chunk's end (its rows run the
/// recurrent DeltaNet form, as a call starting there would); otherwise it takes whole chunks, and
/// the last partial chunk joins them only if its rows would get the same kind of product
/// (`class`) on their own. So the rows of one chunk see the same kernels whatever the piece, and a
/// prompt gives the same bytes however its calls are cut at multiples of 64.
pub fn piece_len(pos: u32, left: u32, max: u32, class: impl Fn(u32) -> ColumnClass) -> u32 {
    let to_boundary = (CHUNK - pos % CHUNK) % CHUNK;
    if to_boundary > 0 {
        return left.min(to_boundary);
    }
    if left > max {
        return max;
    }
    let tail = left % CHUNK;
    if left > CHUNK && tail > 0 && class(tail) != class(CHUNK) {
        left - tail
    } else {
        left
    }
}

pub struct EngineOptions {
    pub layers: Option<(u32, u32)>,
    pub slots: u32,
    pub ctx: u32,
    pub device: Option<String>,
    /// f32 products throughout (the float64-reference gates); false: tensor-core (f16-input)
    /// mat-mats for prefill where the adapter has them.
    pub precise: bool,
    /// KV cache element types; None: f16, or f32 with `precise` (see [`EngineOptions::kv_types`]).
    pub cache_type_k: Option<KvType>,
    pub cache_type_v: Option<KvType>,
    /// Positions per prefill piece (a multiple of 64, the DeltaNet chunk); None: the engine's
    /// choice ([`PREFILL_PIECE_LARGE`] where it fits, else [`PREFILL_PIECE`]). Results do not
    /// depend on it; the scratch and the prefill speed do.
    pub prefill_rows: Option<u32>,
    /// Decode steps of at most this many rows route their tokens inside the experts' gate/up
    /// product (one dispatch fewer); larger ones run the router kernel first, which routes each
    /// token once instead of in every workgroup of the product. None: 1 — on the H200 (kernel
    /// bench, 2026-12-02) routing inside took 17.0 µs per layer against 20.3 for the router kernel
    /// then the product at 1 token, 29.3 vs 27.8 at 2 and 91.0 vs 72.9 at 8, and the engine's 8
    /// slots stepped together went from 560.6 to 588.8 tok/s. The results are the same bytes
    /// either way (one routing code, common_route.wgsl); only the speed differs.
    pub route_inside_max_rows: Option<u32>,
    /// How decode attention walks a row's keys (key columns per workgroup, keys per column per
    /// iteration, shortest split); None: [`DecodeTuning::DEFAULT`]. A speed choice a bench can
    /// compare in one process; it changes the last bits of attention (the split plan and so the
    /// merge), never a row's independence from the batch.
    pub attention_walk: Option<DecodeTuning>,
    /// Columns one workgroup of the decode step's dense mat-vecs (the projections, the router)
    /// takes at most, 1–8; a step of more slots splits them into equal groups where they divide
    /// evenly. None: [`DENSE_GROUP_COLS`]. A speed choice a bench can compare in one process:
    /// every column's bytes are the same for any value.
    pub dense_group_cols: Option<u32>,
    /// Launch shapes for the decode step's mat-vecs, by the profile's op name (one of
    /// [`SHAPED_DECODE_OPS`]: the dense ones and the experts'), at every column count: for benches
    /// comparing shapes in the engine itself (the kernel bench's isolated dispatch has disagreed
    /// with it). A shape's width fixes how a row's K is split, so it changes the op's last bits;
    /// the same for every batch.
    pub decode_shapes: Vec<(String, MatvecShape)>,
    /// How long a decode step's wait for the GPU polls without sleeping before it blocks; None:
    /// [`SPIN_WAIT`] on a GPU, zero on a CPU adapter (whose own threads need the cores a spinning
    /// host would take). The same results either way: a speed choice.
    pub spin_wait: Option<Duration>,
    /// Small weight tensors as ranges of a few shared buffers ([`crate::gpu::WeightArena`]: each
    /// buffer a step references costs wgpu's submit host time); None: on. The same bytes either way.
    pub weight_arena: Option<bool>,
    /// Arm host-fed decode steps (Vulkan; else ignored): right after such a step is handed to the
    /// GPU — a split stage's `step`, or a `step_submit` of rows not followed by a chained step
    /// (`chain_next` false: a sampled request's) — the likely next step is recorded and submitted
    /// too, waiting on the GPU for a semaphore that the next call signals once its input is in
    /// mapped memory, so that call's submit is no longer between the input's arrival and the GPU's
    /// start. The engine then takes a device of its own (an armed submit holds back its queue) and
    /// one spare slot of recurrent state, where a step armed for a call that did not come runs when
    /// it is retired (one step of GPU time at the end of each streak). None: off. The same bytes
    /// either way.
    pub armed_steps: Option<bool>,
    /// Decode steps of at least this many slots (2–16) run their dense products (the mixers'
    /// projections; not the F32 router) on tensor cores ([`crate::ops::matmul::matvec_coop`]),
    /// where the adapter has cooperative matrices and the precision is fast. None: never. Each
    /// weight is then read once for all the slots with the arithmetic on the matrix units, where
    /// the mat-vec's grows with the slots; the inputs are f16, as prefill's products. Such a step
    /// no longer gives a slot the bytes it gets stepping alone (another kernel); split ≡ unsplit
    /// and reuse ≡ no reuse still hold. Off: on the H200 (2026-12-05) it halved the 8-slot step's
    /// rate, the 128-row tile leaving 16–96 workgroups per product unsplit in K; a 32-row tile
    /// splitting K among its subgroups lost too (H100, 2026-12-06: a tile's dependent K steps
    /// cost more than the mat-vec's one pass; benches/RESULTS.md).
    pub tensor_core_decode_cols: Option<u32>,
}

/// A decode step's spinning wait on a GPU: longer than any decode step, so a step never sleeps in
/// the driver, short enough that an idle-looking wait does not hold a core for long.
pub const SPIN_WAIT: Duration = Duration::from_millis(20);

/// One slot of 4,096 positions on the default adapter, every other choice the engine's (the
/// Python `Engine`'s defaults).
impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            layers: None,
            slots: 1,
            ctx: 4096,
            device: None,
            precise: false,
            cache_type_k: None,
            cache_type_v: None,
            prefill_rows: None,
            route_inside_max_rows: None,
            attention_walk: None,
            dense_group_cols: None,
            decode_shapes: Vec::new(),
            spin_wait: None,
            weight_arena: None,
            armed_steps: None,
            tensor_core_decode_cols: None,
        }
    }
}

impl EngineOptions {
    /// The K and V cache types: as given, else f16 (llama.cpp's default), or f32 under `precise`.
    pub fn kv_types(&self) -> (KvType, KvType) {
        let default = if self.precise { KvType::F32 } else { KvType::F16 };
        (
            self.cache_type_k.unwrap_or(default),
            self.cache_type_v.unwrap_or(default),
        )
    }
}

pub struct Engine {
    pub gpu: Arc<Gpu>,
    model: Model,
    pub layers: (u32, u32),
    slots: Vec<SlotState>,
    scratch: Scratch,
    /// Most positions per prefill piece (`EngineOptions::prefill_rows`, a multiple of 64).
    prefill_rows: u32,
    /// How long a decode step's wait polls before it blocks (`EngineOptions::spin_wait`).
    spin_wait: Duration,
    /// Whether the small weights are packed into arena buffers (`EngineOptions::weight_arena`).
    weight_arena: bool,
    snapshots: HashMap<u64, Snapshot>,
    last_step: Option<StepTiming>,
    /// Every plain (not profiled) decode step's timing, summed.
    step_totals: StepTotals,
    kv_types: (KvType, KvType),
    /// The decode step recorded while the previous one ran (see `submit_inner`).
    ahead: Option<Ahead>,
    /// What `scratch.slots` holds (None: unknown). A decode streak steps the same slots step after
    /// step, and a queue write is a staging buffer and a copy ahead of the step (kernel bench
    /// `host`, H200: +3.6 µs of host and +6.4 µs to the results per write), so an unchanged table
    /// is not written again.
    slot_table: Option<Vec<u32>>,
    /// Decode steps submitted and not yet collected, oldest first.
    in_flight: VecDeque<InFlight>,
    next_step_id: u64,
    /// Slots and top-k of the last decode step whose top-k rows still sit in `scratch.results`
    /// (nothing has written them since): what a chained step may take its tokens from.
    chain_from: Option<(Vec<usize>, u32)>,
    /// Armed decode steps (`EngineOptions::armed_steps`), where they are on.
    arming: Option<Arming>,
}

/// The state of armed decode steps: the mapped inputs and their semaphore, which input buffer the
/// next step takes, and the step armed for the likely next call. A step in this mode copies its
/// slot table (at byte 0) and input rows (at `rows_at`) from its input buffer at its start.
struct Arming {
    inputs: ArmedInputs,
    rows_at: u64,
    parity: usize,
    pending: Option<ArmedStep>,
    /// The last submit that read each input buffer.
    used_by: [Option<wgpu::SubmissionIndex>; 2],
    /// The last step run through the armed path (the next guess looks at it and the current one).
    last: Option<StepShape>,
}

/// A decode step submitted to wait for semaphore value `value`, reading input buffer `parity`.
struct ArmedStep {
    shape: StepShape,
    parity: usize,
    value: u64,
    tickets: Vec<usize>,
    submitted: Submitted,
}

/// Where a decode step's input rows come from.
pub enum StepFeed<'a> {
    /// Token ids or hidden rows from the caller.
    Rows(StageInput<'a>),
    /// The greedy ids of the previous step over the same slots, read on the GPU from its top-k
    /// rows: the step can be submitted before that one's results reach the host.
    Chained,
}

/// The most steps in flight; older uncollected ones are dropped (their results unread).
const MAX_IN_FLIGHT: usize = 8;

/// How a recorded step gets its input rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Feed {
    Tokens,
    Hidden,
    /// Ids from `scratch.results` at a stride of `stride` words (2k for top-k rows of k pairs).
    Chained {
        stride: u32,
    },
}

/// A decode step submitted and not yet collected.
struct InFlight {
    id: u64,
    shape: StepShape,
    /// The caller's top-k (0: the greedy id alone).
    topk: u32,
    tickets: Vec<usize>,
    submitted: Submitted,
    started: Instant,
    submit_begin: Instant,
    submitted_at: Instant,
    /// Recorded ahead, while the step before it ran.
    ahead: bool,
}

/// What a recorded decode step is for: its rows' slots and positions, the top-k, and where its
/// rows come from.
#[derive(Clone, Debug, PartialEq, Eq)]
struct StepShape {
    slots: Vec<usize>,
    positions: Vec<u32>,
    k: u32,
    feed: Feed,
}

impl StepShape {
    /// The same slots one position on, fed as `feed`: what the next call most likely asks for.
    fn advanced(&self, feed: Feed) -> StepShape {
        StepShape {
            positions: self.positions.iter().map(|p| p + 1).collect(),
            feed,
            ..self.clone()
        }
    }
}

/// A decode step recorded ahead of its call.
struct Ahead {
    shape: StepShape,
    encoded: Encoded,
    tickets: Vec<usize>,
    /// An armed engine's: the input buffer its first commands copy from.
    input: Option<usize>,
}

impl Engine {
    /// Load layers [a, b) of the GGUF at `path`; `progress` gets one line per loading step.
    pub fn load(path: &str, opts: &EngineOptions, progress: &mut dyn FnMut(&str)) -> Result<Engine> {
        let file = GgufFile::open(path)?;
        let cfg = ModelConfig::from_gguf(&file)?;
        let layers = opts.layers.unwrap_or((0, cfg.n_layer));
        crate::ensure!(
            opts.slots >= 1,
            QkError::Engine("slots must be at least 1".into())
        );
        crate::ensure!(opts.ctx >= 1, QkError::Engine("ctx must be at least 1".into()));
        let attention_walk = opts.attention_walk.unwrap_or(DecodeTuning::DEFAULT);
        attention_walk.check()?;
        if let Some(n) = opts.tensor_core_decode_cols {
            crate::ensure!(
                (2..=16).contains(&n),
                QkError::Engine(format!("tensor_core_decode_cols must be 2 to 16, not {n}"))
            );
        }
        let dense_group_cols = opts.dense_group_cols.unwrap_or(DENSE_GROUP_COLS);
        crate::ensure!(
            (1..=MATVEC_MAX_COLS).contains(&dense_group_cols),
            QkError::Engine(format!(
                "dense_group_cols must be 1 to {MATVEC_MAX_COLS}, not {dense_group_cols}"
            ))
        );
        if let Some(rows) = opts.prefill_rows {
            crate::ensure!(
                rows >= CHUNK && rows.is_multiple_of(CHUNK),
                QkError::Engine(format!(
                    "prefill_rows must be a positive multiple of {CHUNK} (the DeltaNet chunk), not {rows}"
                ))
            );
        }
        let (k_type, v_type) = opts.kv_types();
        let shape = attn_shape(&cfg, opts.ctx, k_type, v_type);
        shape.validate()?;
        Weights::check_types(&file, layers)?;
        let mut gopts = GpuOptions::from_env();
        if opts.device.is_some() {
            gopts.device = opts.device.clone();
        }
        let armed = opts.armed_steps == Some(true);
        // An armed submit holds back everything after it on its queue: an armed engine shares its
        // device with no other engine (two stages in one process would wait on each other).
        let gpu = if armed {
            Arc::new(Gpu::new(&gopts)?)
        } else {
            shared_gpu(&gopts)?
        };
        let armed = armed && gpu.adapter.backend == "vulkan";
        for (op, shape) in &opts.decode_shapes {
            crate::ensure!(
                SHAPED_DECODE_OPS.contains(&op.as_str()),
                QkError::Engine(format!(
                    "decode_shapes: {op:?} is not one of the decode step's ops {SHAPED_DECODE_OPS:?}"
                ))
            );
            crate::ensure!(
                shape.col_groups == 1 || !EXPERT_DECODE_OPS.contains(&op.as_str()),
                QkError::Engine(format!("decode_shapes: {op} takes no column groups"))
            );
            crate::ensure!(
                shape.is_within_limits() && shape.wg >= gpu.caps.subgroup_max_size,
                QkError::Engine(format!(
                    "decode_shapes: {op}: {shape:?} is not a launch shape (rows 1-16, a power-of-two \
                     width of 8-1024 and at least the subgroup, 1-4 steps, 1-8 column groups)"
                ))
            );
        }
        progress(&format!(
            "{}: {} layers [{}, {}) of {} ({} MTP skipped) on {}",
            cfg.arch.name(),
            layers.1.saturating_sub(layers.0),
            layers.0,
            layers.1,
            cfg.n_layer,
            cfg.n_mtp,
            gpu.adapter.name
        ));
        let weight_arena = opts.weight_arena.unwrap_or(true);
        let weights = Weights::load(&gpu, &file, &cfg, layers, weight_arena, progress)?;
        let freqs = gpu.buffer_from_f32("rope.freqs", &freq_table(cfg.n_rot, cfg.rope_base))?;
        let slots = SlotState::new_all(&gpu, &cfg, &weights.layers, shape, opts.slots, armed)?;
        let has_head = weights.output.is_some();
        let legacy = weights.layers.iter().any(
            |l| matches!(&l.mixer, Mixer::DeltaNet(d) if matches!(d.proj, DeltaNetProjection::Legacy(_))),
        );
        let scratch_for = |piece: u32| {
            Scratch::new(
                &gpu,
                &cfg,
                piece.max(opts.slots),
                HEAD_ROWS.max(opts.slots),
                opts.slots,
                has_head,
                legacy,
            )
        };
        let (prefill_rows, scratch) = match opts.prefill_rows {
            Some(piece) => (piece, scratch_for(piece)?),
            None if gpu.adapter.device_type == "DiscreteGpu" => match scratch_for(PREFILL_PIECE_LARGE) {
                Ok(s) => (PREFILL_PIECE_LARGE, s),
                Err(QkError::OutOfMemory(_)) => (PREFILL_PIECE, scratch_for(PREFILL_PIECE)?),
                Err(e) => return Err(e),
            },
            None => (PREFILL_PIECE, scratch_for(PREFILL_PIECE)?),
        };
        let spin_wait = opts.spin_wait.unwrap_or(if gpu.adapter.device_type == "Cpu" {
            Duration::ZERO
        } else {
            SPIN_WAIT
        });
        let arming = if armed {
            let rows_at = (u64::from(opts.slots) * 4).div_ceil(16) * 16;
            let row_bytes = if layers.0 == 0 {
                4
            } else {
                u64::from(cfg.n_embd) * 4
            };
            ArmedInputs::new(&gpu, rows_at + u64::from(opts.slots) * row_bytes)?.map(|inputs| Arming {
                inputs,
                rows_at,
                parity: 0,
                pending: None,
                used_by: [None, None],
                last: None,
            })
        } else {
            None
        };
        let engine = Engine {
            gpu,
            model: Model {
                cfg,
                weights,
                freqs,
                ctx: opts.ctx,
                precision: if opts.precise {
                    Precision::Precise
                } else {
                    Precision::Fast
                },
                route_inside_max_rows: opts.route_inside_max_rows.unwrap_or(1),
                attention_walk,
                dense_group_cols,
                decode_shapes: opts.decode_shapes.clone(),
                tensor_core_decode_cols: opts.tensor_core_decode_cols.filter(|_| !opts.precise),
            },
            spin_wait,
            weight_arena,
            kv_types: (k_type, v_type),
            layers,
            slots,
            scratch,
            prefill_rows,
            snapshots: HashMap::new(),
            last_step: None,
            step_totals: StepTotals::default(),
            ahead: None,
            slot_table: None,
            in_flight: VecDeque::new(),
            next_step_id: 0,
            chain_from: None,
            arming,
        };
        engine.build_decode_shapes()?;
        let m = engine.memory();
        progress(&format!(
            "loaded: weights {:.1} MiB, KV ({} K, {} V) {:.1} MiB + DeltaNet state {:.1} MiB per slot, scratch {:.1} MiB, total {:.1} MiB{}",
            mib(m.weights),
            k_type.name(),
            v_type.name(),
            mib(m.kv_per_slot),
            mib(m.deltanet_per_slot),
            mib(m.scratch),
            mib(m.total),
            if engine.armed_steps() {
                "; armed steps (a device of its own, one spare slot of DeltaNet state)"
            } else {
                ""
            }
        ));
        Ok(engine)
    }

    pub fn config(&self) -> &ModelConfig {
        &self.model.cfg
    }

    pub fn ctx(&self) -> u32 {
        self.model.ctx
    }

    /// Most positions per prefill piece (one readback each).
    pub fn prefill_rows(&self) -> u32 {
        self.prefill_rows
    }

    /// How long a decode step's wait polls before it blocks.
    pub fn spin_wait(&self) -> Duration {
        self.spin_wait
    }

    pub fn weight_arena(&self) -> bool {
        self.weight_arena
    }

    pub fn n_slots(&self) -> usize {
        self.slots.len()
    }

    pub fn position(&self, slot: usize) -> Result<u32> {
        Ok(self.slot(slot)?.pos)
    }

    pub fn is_first(&self) -> bool {
        self.layers.0 == 0
    }

    pub fn is_last(&self) -> bool {
        self.layers.1 == self.model.cfg.n_layer
    }

    pub fn counters(&self) -> CounterSnapshot {
        self.gpu.counters()
    }

    /// The K and V cache element types.
    pub fn kv_types(&self) -> (KvType, KvType) {
        self.kv_types
    }

    pub fn memory(&self) -> Memory {
        let cfg = &self.model.cfg;
        let local = &self.model.cfg.kinds[self.layers.0 as usize..self.layers.1 as usize];
        let n_attn = local.iter().filter(|k| **k == LayerKind::Attention).count() as u64;
        let n_dn = local.len() as u64 - n_attn;
        let (k_type, v_type) = self.kv_types;
        let kv = n_attn * attn_shape(cfg, self.model.ctx, k_type, v_type).slot_bytes();
        let dn = n_dn * (crate::model::forward::conv_bytes(cfg) + crate::model::forward::ssm_bytes(cfg));
        let snaps: u64 = self.snapshots.values().map(|s| s.buffer.size).sum();
        let weights = self.model.weights.bytes;
        let scratch = self.scratch.bytes;
        let slots = self.slots.len() as u64;
        // Armed steps keep one spare slot of recurrent state (no KV) for retired steps.
        let spare = if self.arming.is_some() { dn } else { 0 };
        Memory {
            weights,
            kv_per_slot: kv,
            deltanet_per_slot: dn,
            scratch,
            snapshots: snaps,
            total: weights + slots * (kv + dn) + spare + scratch + snaps,
        }
    }

    fn slot(&self, slot: usize) -> Result<&SlotState> {
        self.slots.get(slot).ok_or_else(|| {
            QkError::Engine(format!(
                "slot {slot} out of range (engine has {})",
                self.slots.len()
            ))
        })
    }

    /// Check `base` against the slot (0 resets it) and that `n` more positions fit the context.
    fn begin(&mut self, slot: usize, base: u32, n: usize) -> Result<()> {
        let ctx = self.model.ctx;
        let pos = self.slot(slot)?.pos;
        if base != 0 && base != pos {
            return Err(QkError::Engine(format!(
                "slot {slot}: base {base} does not continue the slot's position {pos} (use 0 to restart)"
            )));
        }
        let end = u64::from(base) + n as u64;
        if end > u64::from(ctx) {
            return Err(QkError::Engine(format!(
                "slot {slot}: positions up to {end} exceed the context of {ctx}"
            )));
        }
        if base == 0 {
            let gpu = &self.gpu;
            self.slots[slot].reset(gpu, &self.model.cfg)?;
        }
        Ok(())
    }

    fn check_input(&self, input: &StageInput<'_>) -> Result<()> {
        let cfg = &self.model.cfg;
        match input {
            StageInput::Tokens(t) => {
                crate::ensure!(
                    self.is_first(),
                    QkError::Engine(format!(
                        "layers start at {}: this stage takes hidden rows, not tokens",
                        self.layers.0
                    ))
                );
                if let Some(bad) = t.iter().find(|&&id| id >= cfg.vocab) {
                    return Err(QkError::Engine(format!(
                        "token id {bad} outside the vocabulary of {}",
                        cfg.vocab
                    )));
                }
            }
            StageInput::Hidden(h) => {
                crate::ensure!(
                    !self.is_first(),
                    QkError::Engine("this stage owns the embedding: pass token ids".into())
                );
                crate::ensure!(
                    h.len() % cfg.n_embd as usize == 0,
                    QkError::Engine(format!(
                        "hidden input of {} floats is not whole rows of {}",
                        h.len(),
                        cfg.n_embd
                    ))
                );
            }
        }
        Ok(())
    }

    /// Write rows [lo, hi) of the input where the first layer reads them.
    fn write_input(&self, input: &StageInput<'_>, lo: usize, hi: usize) -> Result<()> {
        let e = self.model.cfg.n_embd as usize;
        match input {
            StageInput::Tokens(t) => {
                self.gpu
                    .write(&self.scratch.tokens, 0, bytemuck::cast_slice(&t[lo..hi]))
            }
            StageInput::Hidden(h) => {
                self.gpu
                    .write(&self.scratch.x[0], 0, bytemuck::cast_slice(&h[lo * e..hi * e]))
            }
        }
    }

    /// Run positions [base, base + n) of `slot`; `topk` pairs of the final position (last stage).
    pub fn stage_run(
        &mut self,
        slot: usize,
        input: StageInput<'_>,
        base: u32,
        topk: u32,
    ) -> Result<StageOutput> {
        let (out, _) = self.run(slot, input, base, topk, HeadRows::All, None)?;
        Ok(out)
    }

    /// [`Engine::stage_run`] that returns only the final position's id (and top-k): the LM head runs
    /// on the final position's head group of the final piece alone, computed exactly as in
    /// `stage_run` (same rows, same kernels), so the id and top-k are the same bytes. What serving
    /// needs of a prompt; the head over every row was 5% of a prefill piece on the H200.
    pub fn stage_run_last(
        &mut self,
        slot: usize,
        input: StageInput<'_>,
        base: u32,
        topk: u32,
    ) -> Result<StageOutput> {
        let (out, _) = self.run(slot, input, base, topk, HeadRows::Last, None)?;
        Ok(out)
    }

    /// [`Engine::stage_run`] profiled like [`Engine::profile_step`]: the dispatches of every
    /// prefill piece (profiled, a piece of at most [`Engine::prefill_rows`] rows is one submit) in
    /// one profile, host times summed over the pieces.
    pub fn profile_stage_run(
        &mut self,
        slot: usize,
        input: StageInput<'_>,
        base: u32,
        topk: u32,
    ) -> Result<(StageOutput, StepProfile)> {
        let rows = input.len(self.model.cfg.n_embd) as u32;
        let before = self.gpu.counters();
        let started = Instant::now();
        let mut pieces = Vec::new();
        let (out, _) = self.run(slot, input, base, topk, HeadRows::All, Some(&mut pieces))?;
        let total_us = started.elapsed().as_secs_f64() * 1e6;
        let after = self.gpu.counters();
        let mut submit = SubmitProfile {
            timestamps: !pieces.is_empty() && pieces.iter().all(|p| p.timestamps),
            gpu_span_ns: Some(0.0),
            ..Default::default()
        };
        for p in pieces {
            let ops_before = submit.dispatches.last().map_or(0, |d| d.op_index + 1);
            submit.record_ns += p.record_ns;
            submit.submit_ns += p.submit_ns;
            submit.wait_ns += p.wait_ns;
            submit.gpu_span_ns = submit.gpu_span_ns.zip(p.gpu_span_ns).map(|(a, b)| a + b);
            submit.dispatches.extend(p.dispatches.into_iter().map(|mut d| {
                d.op_index += ops_before;
                d
            }));
        }
        let timing = StepTiming {
            rows,
            record_us: submit.record_ns / 1e3,
            submit_us: submit.submit_ns / 1e3,
            wait_us: submit.wait_ns / 1e3,
            total_us,
            ahead: false,
        };
        let profile = StepProfile {
            rows,
            submit,
            counters: counter_delta(&before, &after),
            timing,
            normal: None,
        };
        Ok((out, profile))
    }

    /// Logits [n, vocab] of every position (tests; last stage only).
    pub fn logits(&mut self, slot: usize, tokens: &[u32], base: u32) -> Result<Vec<f32>> {
        crate::ensure!(
            self.is_last(),
            QkError::Engine("logits need the LM head (last stage)".into())
        );
        let (_, logits) = self.run(slot, StageInput::Tokens(tokens), base, 1, HeadRows::Logits, None)?;
        Ok(logits)
    }

    fn run(
        &mut self,
        slot: usize,
        input: StageInput<'_>,
        base: u32,
        topk: u32,
        head: HeadRows,
        mut profiles: Option<&mut Vec<SubmitProfile>>,
    ) -> Result<(StageOutput, Vec<f32>)> {
        let want_logits = head == HeadRows::Logits;
        self.check_input(&input)?;
        self.disarm()?;
        let n = input.len(self.model.cfg.n_embd);
        crate::ensure!(n > 0, QkError::Engine("stage_run with no rows".into()));
        crate::ensure!(
            topk <= MAX_K,
            QkError::Engine(format!("top-k of {topk} exceeds {MAX_K}"))
        );
        self.begin(slot, base, n)?;
        // A prefill writes the top-k rows a chained step would read its tokens from.
        self.chain_from = None;
        let last = self.is_last();
        let mut hidden = Vec::new();
        let mut ids = Vec::with_capacity(n);
        let mut top = Vec::new();
        let mut logits = Vec::new();
        let mut done = 0usize;
        // Logits are read back whole, so a call that wants them runs one head group per piece.
        let max = if want_logits { HEAD_ROWS } else { self.prefill_rows };
        while done < n {
            let pos = base + done as u32;
            let (gpu, precision) = (&self.gpu, self.model.precision);
            let len = piece_len(pos, (n - done) as u32, max, |c| column_class(gpu, precision, c)) as usize;
            let final_piece = done + len == n;
            self.write_input(&input, done, done + len)?;
            let s = &self.scratch;
            let gpu = &self.gpu;
            let st = &self.slots[slot];
            let t = len as u32;
            let mut rec = if profiles.is_some() {
                gpu.profiling_recorder()
            } else {
                gpu.recorder()
            };
            let positions = [pos];
            let layers = if len == 1 {
                self.slot_table = None;
                gpu.write(&s.slots, 0, bytemuck::bytes_of(&(slot as u32)))?;
                self.slot_table = Some(vec![slot as u32]);
                write_step_rows(gpu, s, &[st], &positions)?;
                LayerRows::Step {
                    states: vec![st],
                    positions: &positions,
                }
            } else {
                LayerRows::Piece { state: st, base: pos }
            };
            let plan = ForwardPlan {
                feed: match input {
                    StageInput::Tokens(_) => Feed::Tokens,
                    StageInput::Hidden(_) => Feed::Hidden,
                },
                n: t,
                layers,
                head: HeadPlan::Piece {
                    k: if final_piece { topk.max(1) } else { 1 },
                    rows: head,
                    final_piece,
                },
            };
            let reads = self.record_forward(&mut rec, &plan)?;
            let submitted = rec.finish()?.submit(gpu);
            if final_piece && profiles.is_none() {
                self.record_first_step(slot, base + n as u32, topk)?;
            }
            let (out, finished) = submitted.wait(&self.gpu)?;
            if let (Some(list), Some(p)) = (profiles.as_mut(), finished.profile) {
                list.push(p);
            }
            for (i, (ticket, k)) in reads.ids.iter().enumerate() {
                let pairs: &[IdLogit] = bytemuck::cast_slice(&out[*ticket]);
                if i + 1 < reads.ids.len() {
                    // The batch of k = 1 rows: one pair per row.
                    ids.extend(pairs.iter().map(|p| p.id));
                    continue;
                }
                ids.push(pairs[0].id);
                if final_piece && topk > 0 {
                    top = pairs[..*k as usize].iter().map(|p| (p.id, p.logit)).collect();
                }
            }
            if let Some(tk) = reads.hidden {
                hidden.extend_from_slice(bytemuck::cast_slice::<u8, f32>(&out[tk]));
            }
            if let Some(tk) = reads.logits {
                logits.extend_from_slice(bytemuck::cast_slice::<u8, f32>(&out[tk]));
            }
            self.slots[slot].pos = pos + t;
            done += len;
        }
        let result = if last {
            StageOutput::Ids { ids, topk: top }
        } else {
            StageOutput::Hidden(hidden)
        };
        Ok((result, logits))
    }

    /// While a prompt's last piece runs, record the decode step most likely next — this slot alone
    /// at `pos`, with the prompt's top-k — so its call finds it recorded ahead (a streak's first
    /// step otherwise records on the critical path: ~2–3 ms of host work for a 48-layer step on the
    /// H200). Another call discards it.
    fn record_first_step(&mut self, slot: usize, pos: u32, topk: u32) -> Result<()> {
        if pos >= self.model.ctx {
            return Ok(());
        }
        let shape = StepShape {
            slots: vec![slot],
            positions: vec![pos],
            k: topk.max(1),
            feed: if self.is_first() {
                Feed::Tokens
            } else {
                Feed::Hidden
            },
        };
        // An armed engine submits it from the input buffer it will take next (nothing else takes one
        // before that step: every other call retires and submits without one).
        let input = self.arming.as_ref().map(|a| a.parity);
        let (encoded, tickets) = self.record_step(&shape, false, input)?;
        if let Some(old) = self.ahead.replace(Ahead {
            shape,
            encoded,
            tickets,
            input,
        }) {
            old.encoded.discard(&self.gpu);
        }
        Ok(())
    }

    /// One decode position for each of `slots` (distinct) in one recorded pass: token i (or hidden
    /// row i) goes to slots[i] at its current position. Returns one output per slot.
    pub fn step(&mut self, slots: &[usize], input: StageInput<'_>, topk: u32) -> Result<Vec<StageOutput>> {
        let id = self.step_submit(slots, StepFeed::Rows(input), topk, false)?;
        self.step_collect(id)
    }

    /// Submit one decode step of `slots` without waiting for it; [`Engine::step_collect`] returns
    /// its results. `StepFeed::Chained` takes each slot's token from the previous step over the
    /// same slots (its greedy id, on the GPU), so it can be submitted while that step still runs
    /// (first and last stage only). `chain_next`: the caller means to chain the next step, so that
    /// is the one recorded ahead. Slot positions advance at the submit.
    pub fn step_submit(
        &mut self,
        slots: &[usize],
        feed: StepFeed<'_>,
        topk: u32,
        chain_next: bool,
    ) -> Result<u64> {
        // Rows not followed by a chained step: the next call most likely brings rows too.
        let arm = self.arming.is_some() && !chain_next && matches!(feed, StepFeed::Rows(_));
        let f = self.submit_inner(slots, feed, topk, false, chain_next, arm)?;
        let id = f.id;
        if self.in_flight.len() >= MAX_IN_FLIGHT {
            self.in_flight.pop_front();
        }
        self.in_flight.push_back(f);
        Ok(id)
    }

    /// Wait for step `id` (from [`Engine::step_submit`]) and return its results. Steps submitted
    /// before it and not collected are dropped unread.
    pub fn step_collect(&mut self, id: u64) -> Result<Vec<StageOutput>> {
        while let Some(f) = self.in_flight.pop_front() {
            if f.id == id {
                return Ok(self.collect_inner(f)?.0);
            }
            if f.id > id {
                self.in_flight.push_front(f);
                break;
            }
        }
        Err(QkError::Engine(format!(
            "decode step {id} is not in flight (never submitted, or already collected)"
        )))
    }

    /// Host timing of the last [`Engine::step`] (None before the first).
    pub fn last_step_timing(&self) -> Option<StepTiming> {
        self.last_step
    }

    /// Every decode step's host timing summed since load (profiled steps left out).
    pub fn step_totals(&self) -> StepTotals {
        self.step_totals
    }

    /// [`Engine::step`] with every dispatch labelled and, where the adapter has timestamp queries,
    /// timed on the GPU (one pass per dispatch; results are the same bytes as `step`'s). Creates
    /// query sets and buffers, so it is for measurement, not for serving.
    pub fn profile_step(
        &mut self,
        slots: &[usize],
        input: StageInput<'_>,
        topk: u32,
    ) -> Result<(Vec<StageOutput>, StepProfile)> {
        let (normal, totals) = (self.last_step, self.step_totals);
        let before = self.gpu.counters();
        let f = self.submit_inner(slots, StepFeed::Rows(input), topk, true, false, false)?;
        let (out, submit, timing) = self.collect_inner(f)?;
        let after = self.gpu.counters();
        let submit =
            submit.ok_or_else(|| QkError::Engine("profiling recorder returned no profile".into()))?;
        (self.last_step, self.step_totals) = (normal, totals);
        let counters = counter_delta(&before, &after);
        let profile = StepProfile {
            rows: slots.len() as u32,
            submit,
            counters,
            timing,
            normal,
        };
        Ok((out, profile))
    }

    /// `arm`: an armed engine's host-fed step that fires the step armed for it (or submits it) and
    /// arms the next; every other step of an armed engine first retires what is armed.
    fn submit_inner(
        &mut self,
        slots: &[usize],
        feed: StepFeed<'_>,
        topk: u32,
        profile: bool,
        chain_next: bool,
        arm: bool,
    ) -> Result<InFlight> {
        let started = Instant::now();
        let n = slots.len();
        crate::ensure!(n > 0, QkError::Engine("step with no slots".into()));
        crate::ensure!(
            topk <= MAX_K,
            QkError::Engine(format!("top-k of {topk} exceeds {MAX_K}"))
        );
        crate::ensure!(
            n <= self.scratch.rows as usize,
            QkError::Engine(format!(
                "step over {n} slots exceeds the scratch of {} rows",
                self.scratch.rows
            ))
        );
        let feed_kind = match &feed {
            StepFeed::Rows(input) => {
                self.check_input(input)?;
                crate::ensure!(
                    input.len(self.model.cfg.n_embd) == n,
                    QkError::Engine(format!(
                        "step: {} input rows for {n} slots",
                        input.len(self.model.cfg.n_embd)
                    ))
                );
                match input {
                    StageInput::Tokens(_) => Feed::Tokens,
                    StageInput::Hidden(_) => Feed::Hidden,
                }
            }
            StepFeed::Chained => match &self.chain_from {
                Some((from, k)) if from.as_slice() == slots && self.is_first() && self.is_last() => {
                    Feed::Chained { stride: 2 * k }
                }
                _ => {
                    return Err(QkError::Engine(
                        "a chained step follows a decode step over the same slots with nothing run \
                         between (and needs the embedding and the LM head)"
                            .into(),
                    ));
                }
            },
        };
        for (i, &s) in slots.iter().enumerate() {
            crate::ensure!(
                !slots[..i].contains(&s),
                QkError::Engine(format!("step: slot {s} given twice"))
            );
            let pos = self.slot(s)?.pos;
            self.begin(s, pos, 1)?;
        }
        let shape = StepShape {
            slots: slots.to_vec(),
            positions: slots.iter().map(|&s| self.slots[s].pos).collect(),
            k: topk.max(1),
            feed: feed_kind,
        };
        if let (true, StepFeed::Rows(input)) = (arm, &feed) {
            return self.submit_armed(shape, input, topk, started);
        }
        self.disarm()?;
        if let StepFeed::Rows(input) = &feed {
            self.write_input(input, 0, n)?;
        }
        let slot_table: Vec<u32> = slots.iter().map(|&s| s as u32).collect();
        if self.slot_table.as_ref() != Some(&slot_table) {
            self.slot_table = None;
            self.gpu
                .write(&self.scratch.slots, 0, bytemuck::cast_slice(&slot_table))?;
            self.slot_table = Some(slot_table);
        }
        self.write_rows_of(&shape)?;
        // A step recorded while the previous one ran serves if it was recorded for exactly this.
        let ahead = match self.ahead.take() {
            Some(a) if !profile && a.shape == shape && a.input.is_none() => Some(a),
            Some(a) => {
                a.encoded.discard(&self.gpu);
                None
            }
            None => None,
        };
        let was_ahead = ahead.is_some();
        let (encoded, tickets) = match ahead {
            Some(a) => (a.encoded, a.tickets),
            None => self.record_step(&shape, profile, None)?,
        };
        let submit_begin = Instant::now();
        let submitted = encoded.submit(&self.gpu);
        let submitted_at = Instant::now();
        self.advance(&shape);
        self.chain_from = (self.is_first() && self.is_last()).then(|| (shape.slots.clone(), shape.k));
        // Record the likely next step (same slots, one position on) while the GPU runs this one:
        // its recording then costs the next call nothing. Any other next call discards it.
        if !profile {
            let next_feed = match (chain_next && self.chain_from.is_some(), shape.feed) {
                (true, _) => Feed::Chained { stride: 2 * shape.k },
                (false, Feed::Chained { .. }) => Feed::Tokens,
                (false, f) => f,
            };
            let next = shape.advanced(next_feed);
            if next.positions.iter().all(|&p| p < self.model.ctx) {
                let (encoded, tickets) = self.record_step(&next, false, None)?;
                self.ahead = Some(Ahead {
                    shape: next,
                    encoded,
                    tickets,
                    input: None,
                });
            }
        }
        let clock = [started, submit_begin, submitted_at];
        Ok(self.launched(shape, topk, tickets, submitted, clock, was_ahead))
    }

    /// Write the attention rows (slot, position) of `shape`'s rows, where its step reads them.
    fn write_rows_of(&self, shape: &StepShape) -> Result<()> {
        let states: Vec<&SlotState> = shape.slots.iter().map(|&i| &self.slots[i]).collect();
        write_step_rows(&self.gpu, &self.scratch, &states, &shape.positions)
    }

    /// Move each slot of a step just handed to the GPU one position on.
    fn advance(&mut self, shape: &StepShape) {
        for (&sl, &p) in shape.slots.iter().zip(&shape.positions) {
            self.slots[sl].pos = p + 1;
        }
    }

    /// Number a step just handed to the GPU and keep what its collect needs; `clock`: the call's
    /// start, the submit's start and its end.
    fn launched(
        &mut self,
        shape: StepShape,
        topk: u32,
        tickets: Vec<usize>,
        submitted: Submitted,
        clock: [Instant; 3],
        ahead: bool,
    ) -> InFlight {
        let id = self.next_step_id;
        self.next_step_id += 1;
        let [started, submit_begin, submitted_at] = clock;
        InFlight {
            id,
            shape,
            topk,
            tickets,
            submitted,
            started,
            submit_begin,
            submitted_at,
            ahead,
        }
    }

    fn collect_inner(
        &mut self,
        f: InFlight,
    ) -> Result<(Vec<StageOutput>, Option<SubmitProfile>, StepTiming)> {
        let InFlight {
            shape,
            topk,
            tickets,
            submitted,
            started,
            submit_begin,
            submitted_at,
            ahead,
            ..
        } = f;
        let (out, finished) = submitted.wait_spinning(&self.gpu, self.spin_wait)?;
        let n = shape.slots.len();
        let e = self.model.cfg.n_embd as usize;
        let (last, k) = (self.is_last(), shape.k);
        let mut results = Vec::with_capacity(n);
        if last {
            for t in &tickets {
                let pairs: &[IdLogit] = bytemuck::cast_slice(&out[*t]);
                // The caller's top-k (0: only the greedy id; the step itself ran at least 1).
                let top = if topk > 0 {
                    pairs[..k as usize].iter().map(|p| (p.id, p.logit)).collect()
                } else {
                    Vec::new()
                };
                results.push(StageOutput::Ids {
                    ids: vec![pairs[0].id],
                    topk: top,
                });
            }
        } else {
            let rows: &[f32] = bytemuck::cast_slice(&out[tickets[0]]);
            for i in 0..n {
                results.push(StageOutput::Hidden(rows[i * e..(i + 1) * e].to_vec()));
            }
        }
        let us = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e6;
        let timing = StepTiming {
            rows: n as u32,
            record_us: us(started, submit_begin),
            submit_us: us(submit_begin, submitted_at),
            wait_us: us(submitted_at, finished.done),
            total_us: us(started, Instant::now()),
            ahead,
        };
        self.last_step = Some(timing);
        self.step_totals.add(&timing);
        Ok((results, finished.profile, timing))
    }

    /// An armed engine's step: fire the step armed for exactly this (its input written into its
    /// mapped buffer, then the semaphore signalled), else retire what is armed and submit this one;
    /// then record the same slots' next step and submit it armed.
    fn submit_armed(
        &mut self,
        shape: StepShape,
        input: &StageInput<'_>,
        topk: u32,
        started: Instant,
    ) -> Result<InFlight> {
        let table: Vec<u32> = shape.slots.iter().map(|&s| s as u32).collect();
        let rows: &[u8] = match input {
            StageInput::Tokens(t) => bytemuck::cast_slice(t),
            StageInput::Hidden(h) => bytemuck::cast_slice(h),
        };
        // The step's own copy writes the slot table, and the results it leaves are not a chain's.
        self.slot_table = None;
        self.chain_from = None;
        // Recorded ahead by a prompt's last piece, from an input buffer (see the plain case below).
        let ahead = self.ahead.take();
        let fired = match self.arming.as_mut().and_then(|a| a.pending.take()) {
            Some(p) if p.shape == shape => Some(p),
            Some(p) => {
                self.retire(p)?;
                None
            }
            None => None,
        };
        let (submitted, tickets, submit_begin, was_ahead) = match fired {
            Some(p) => {
                if let Some(a) = ahead {
                    a.encoded.discard(&self.gpu);
                }
                let (gpu, arm) = (&self.gpu, self.arming.as_mut().ok_or_else(no_arming)?);
                let parts = [(0, bytemuck::cast_slice(&table)), (arm.rows_at, rows)];
                let submit_begin = Instant::now();
                arm.inputs.fire(gpu, p.parity, p.value, &parts)?;
                (p.submitted, p.tickets, submit_begin, true)
            }
            None => {
                self.write_rows_of(&shape)?;
                let parity = self.take_parity()?;
                let (gpu, arm) = (&self.gpu, self.arming.as_mut().ok_or_else(no_arming)?);
                let parts = [(0, bytemuck::cast_slice(&table)), (arm.rows_at, rows)];
                arm.inputs.write(gpu, parity, &parts)?;
                let (encoded, tickets, was_ahead) = match ahead {
                    Some(a) if a.shape == shape && a.input == Some(parity) => (a.encoded, a.tickets, true),
                    other => {
                        if let Some(a) = other {
                            a.encoded.discard(&self.gpu);
                        }
                        let (encoded, tickets) = self.record_step(&shape, false, Some(parity))?;
                        (encoded, tickets, false)
                    }
                };
                let submit_begin = Instant::now();
                let submitted = encoded.submit(&self.gpu);
                self.armed_mut()?.used_by[parity] = Some(submitted.index());
                (submitted, tickets, submit_begin, was_ahead)
            }
        };
        let submitted_at = Instant::now();
        self.advance(&shape);
        // Arm the likely next call while the GPU runs this one: its positions' table goes with the
        // armed submit (a queue write rides in the next submit), its rows come at the signal.
        let next = self.likely_next(&shape)?;
        if next.positions.iter().all(|&p| p < self.model.ctx) {
            self.write_rows_of(&next)?;
            let parity = self.take_parity()?;
            let (encoded, next_tickets) = self.record_step(&next, false, Some(parity))?;
            let gpu = Arc::clone(&self.gpu);
            let arm = self.armed_mut()?;
            let (armed, value) = arm.inputs.submit(&gpu, encoded)?;
            arm.used_by[parity] = Some(armed.index());
            arm.pending = Some(ArmedStep {
                shape: next,
                parity,
                value,
                tickets: next_tickets,
                submitted: armed,
            });
        }
        let clock = [started, submit_begin, submitted_at];
        Ok(self.launched(shape, topk, tickets, submitted, clock, was_ahead))
    }

    /// The step an armed engine expects after `shape`: the same slots again, or — when the step
    /// before it was over other slots (a split's two lanes take turns) — that one's slots again,
    /// each at its slot's position now.
    fn likely_next(&mut self, shape: &StepShape) -> Result<StepShape> {
        let arm = self.armed_mut()?;
        let before = arm.last.replace(shape.clone());
        let like = match before {
            Some(b) if b.feed == shape.feed && b.slots.iter().all(|s| !shape.slots.contains(s)) => b,
            _ => shape.clone(),
        };
        Ok(StepShape {
            positions: like.slots.iter().map(|&s| self.slots[s].pos).collect(),
            ..like
        })
    }

    fn armed_mut(&mut self) -> Result<&mut Arming> {
        self.arming.as_mut().ok_or_else(no_arming)
    }

    /// The input buffer the next recorded step of an armed engine takes. They alternate, and the
    /// last step that read the one taken is waited for here (at once in a decode streak, whose
    /// step before last has long finished): the host writes it next, while the step just handed
    /// to the GPU may still read the other. (A step armed on it reads it only after its signal.)
    fn take_parity(&mut self) -> Result<usize> {
        let gpu = Arc::clone(&self.gpu);
        let arm = self.armed_mut()?;
        let parity = arm.parity;
        arm.parity ^= 1;
        if let Some(index) = arm.used_by[parity].take() {
            gpu.wait_for(index)?;
        }
        Ok(parity)
    }

    /// Let an armed step that no call will use run harmlessly, and wait for it: its rows all point
    /// at the spare recurrent state (index `n_slots`) and take zero input. Its attention layers
    /// still write K and V at the slots' next positions, which every later step or prefill of those
    /// positions writes again before anything reads them.
    fn retire(&mut self, p: ArmedStep) -> Result<()> {
        let spare = self.slots.len() as u32;
        let n = p.shape.slots.len();
        let table = vec![spare; n];
        let width = match p.shape.feed {
            Feed::Hidden => self.model.cfg.n_embd as usize,
            _ => 1,
        };
        let zeros = vec![0u8; n * width * 4];
        // It writes the slot table and (last stage) the top-k rows a chained step would read.
        self.slot_table = None;
        self.chain_from = None;
        let (gpu, arm) = (&self.gpu, self.arming.as_mut().ok_or_else(no_arming)?);
        let parts = [(0, bytemuck::cast_slice(&table)), (arm.rows_at, zeros.as_slice())];
        arm.inputs.fire(gpu, p.parity, p.value, &parts)?;
        p.submitted.wait(&self.gpu)?;
        Ok(())
    }

    /// Retire the armed step, if any: before anything else is submitted (it would queue behind it).
    fn disarm(&mut self) -> Result<()> {
        match self.arming.as_mut().and_then(|a| a.pending.take()) {
            Some(p) => self.retire(p),
            None => Ok(()),
        }
    }

    /// From how many slots a decode step's dense products run on tensor cores
    /// (`EngineOptions::tensor_core_decode_cols`; None for a precise engine, and where the adapter
    /// has no cooperative matrices).
    pub fn tensor_core_decode_cols(&self) -> Option<u32> {
        let coop =
            crate::ops::matmul::coop_accumulator(&self.gpu, crate::ops::matmul::CoopTile::NARROW_128X16);
        self.model.tensor_core_decode_cols.filter(|_| coop.is_some())
    }

    /// Whether this engine arms its decode steps (`EngineOptions::armed_steps`, where they apply).
    pub fn armed_steps(&self) -> bool {
        self.arming.is_some()
    }

    /// Record (and drop) a decode step of every row count this engine can step, host-fed and
    /// chained: the pipelines and bind groups of each batch shape are built at load, not by the
    /// first request that makes that batch (a cold driver shader cache put those builds inside a
    /// served step: 2 streams at 166 instead of 262 tok/s on the H200).
    fn build_decode_shapes(&self) -> Result<()> {
        let n_max = self.slots.len().min(self.scratch.rows as usize);
        let mut feeds = vec![if self.is_first() {
            Feed::Tokens
        } else {
            Feed::Hidden
        }];
        if self.is_first() && self.is_last() {
            feeds.push(Feed::Chained { stride: 2 });
        }
        for n in 1..=n_max {
            for &feed in &feeds {
                let shape = StepShape {
                    slots: (0..n).collect(),
                    positions: vec![0; n],
                    k: 1,
                    feed,
                };
                self.record_step(&shape, false, None)?.0.discard(&self.gpu);
            }
        }
        Ok(())
    }

    /// Record one decode step of `shape` (its inputs are written separately, before the submit):
    /// the encoded commands and, per row (last stage) or once (hidden rows), the readback index.
    /// `input`: an armed engine's input buffer the step copies its slot table and rows from.
    fn record_step(
        &self,
        shape: &StepShape,
        profile: bool,
        input: Option<usize>,
    ) -> Result<(Encoded, Vec<usize>)> {
        let n = shape.slots.len();
        let e = self.model.cfg.n_embd as usize;
        let s = &self.scratch;
        let gpu = &self.gpu;
        let states: Vec<&SlotState> = shape.slots.iter().map(|&i| &self.slots[i]).collect();
        let mut rec = if profile {
            gpu.profiling_recorder()
        } else {
            gpu.recorder()
        };
        if let (Some(parity), Some(arm)) = (input, &self.arming) {
            let src = arm.inputs.input(parity);
            rec.copy(src, 0, &s.slots, 0, n as u64 * 4)?;
            match shape.feed {
                Feed::Tokens => rec.copy(src, arm.rows_at, &s.tokens, 0, n as u64 * 4)?,
                Feed::Hidden => rec.copy(src, arm.rows_at, &s.x[0], 0, (n * e * 4) as u64)?,
                Feed::Chained { .. } => {
                    return Err(QkError::Engine(
                        "an armed step takes its rows from the caller".into(),
                    ));
                }
            }
        }
        let plan = ForwardPlan {
            feed: shape.feed,
            n: n as u32,
            layers: LayerRows::Step {
                states,
                positions: &shape.positions,
            },
            head: HeadPlan::EveryRow { k: shape.k },
        };
        let reads = self.record_forward(&mut rec, &plan)?;
        let tickets = match reads.hidden {
            Some(hidden) => vec![hidden],
            None => reads.ids.iter().map(|&(ticket, _)| ticket).collect(),
        };
        Ok((rec.finish()?, tickets))
    }

    /// Record `plan` into `rec`: the embedding (ids from the tokens buffer or chained from the last
    /// step's top-k; hidden rows are in x[0] already), its layers, then the LM head and top-k with
    /// their reads on the last stage, or the read of the hidden rows on another.
    fn record_forward(&self, rec: &mut Recorder<'_>, plan: &ForwardPlan<'_>) -> Result<ForwardReads> {
        let model = &self.model;
        let s = &self.scratch;
        let gpu = &self.gpu;
        let n = plan.n;
        match plan.feed {
            Feed::Tokens => model.record_embed(gpu, rec, s, Ids::packed(&s.tokens), n)?,
            Feed::Chained { stride } => {
                let ids = Ids {
                    buf: &s.results,
                    offset: 0,
                    stride,
                };
                model.record_embed(gpu, rec, s, ids, n)?;
            }
            Feed::Hidden => {}
        }
        let cur = match &plan.layers {
            LayerRows::Step { states, positions } => {
                model.record_decode_layers(gpu, rec, s, states, positions)?
            }
            LayerRows::Piece { state, base } => {
                model.record_layers(gpu, rec, s, &[state], Batch::Prefill { base: *base, n })?
            }
        };
        let mut reads = ForwardReads::default();
        if !self.is_last() {
            let e = u64::from(self.model.cfg.n_embd);
            reads.hidden = Some(rec.read(&s.x[cur], 0, u64::from(n) * e * 4)?);
            return Ok(reads);
        }
        match plan.head {
            HeadPlan::EveryRow { k } => {
                model.record_head(gpu, rec, s, cur, n)?;
                model.record_topk_rows(gpu, rec, s, 0, n, k, &s.results)?;
                for row in 0..u64::from(n) {
                    reads
                        .ids
                        .push((rec.read(&s.results, row * u64::from(k) * 8, u64::from(k) * 8)?, k));
                }
            }
            HeadPlan::Piece { k, rows, final_piece } => {
                // The head over groups of HEAD_ROWS rows: the argmax of every row but the piece's
                // last, gathered in piece_ids; the last row gets its own k.
                // HeadRows::Last: only the final piece's last group, which holds its final row.
                let mut g0 = match rows {
                    HeadRows::Last if final_piece => (n - 1) / HEAD_ROWS * HEAD_ROWS,
                    HeadRows::Last => n,
                    _ => 0,
                };
                while g0 < n {
                    let g = (n - g0).min(HEAD_ROWS);
                    model.record_head_rows(gpu, rec, s, cur, g0, g)?;
                    let argmax_rows = if g0 + g == n { g - 1 } else { g };
                    if argmax_rows > 0 && rows != HeadRows::Last {
                        model.record_topk_rows(gpu, rec, s, 0, argmax_rows, 1, &s.results)?;
                        let bytes = u64::from(argmax_rows) * 8;
                        rec.copy(&s.results, 0, &s.piece_ids, u64::from(g0) * 8, bytes)?;
                    }
                    if g0 + g == n {
                        model.record_topk_rows(gpu, rec, s, g - 1, 1, k, &s.result_last)?;
                    }
                    g0 += g;
                }
                // Every row's ids but the last, then the last row's top k (HeadRows::Last: the
                // final piece's last row alone).
                if rows != HeadRows::Last && n > 1 {
                    reads
                        .ids
                        .push((rec.read(&s.piece_ids, 0, u64::from(n - 1) * 8)?, 1));
                }
                if rows != HeadRows::Last || final_piece {
                    reads
                        .ids
                        .push((rec.read(&s.result_last, 0, u64::from(k) * 8)?, k));
                }
                if rows == HeadRows::Logits {
                    let vocab = u64::from(self.model.cfg.vocab);
                    reads.logits = Some(rec.read(&s.logits, 0, u64::from(n) * vocab * 4)?);
                }
            }
        }
        Ok(reads)
    }

    /// Greedy generation on one slot from position 0: the prompt, then `max_new` tokens.
    pub fn generate(&mut self, slot: usize, prompt: &[u32], max_new: usize) -> Result<Vec<u32>> {
        crate::ensure!(
            self.is_first() && self.is_last(),
            QkError::Engine("generate needs the whole model on this engine".into())
        );
        let mut out = Vec::with_capacity(max_new);
        if max_new == 0 {
            return Ok(out);
        }
        let StageOutput::Ids { ids, .. } = self.stage_run_last(slot, StageInput::Tokens(prompt), 0, 0)?
        else {
            return Err(QkError::Engine("last stage returned hidden rows".into()));
        };
        let mut next = *ids.last().ok_or_else(|| QkError::Engine("empty prompt".into()))?;
        out.push(next);
        while out.len() < max_new {
            let r = self.step(&[slot], StageInput::Tokens(&[next]), 0)?;
            let Some(StageOutput::Ids { ids, .. }) = r.into_iter().next() else {
                return Err(QkError::Engine("last stage returned hidden rows".into()));
            };
            next = ids[0];
            out.push(next);
        }
        Ok(out)
    }

    /// Copy the slot's state (KV rows up to its position, conv rows, S) into snapshot `idx`.
    pub fn state_save(&mut self, slot: usize, idx: u64) -> Result<()> {
        self.disarm()?;
        let st = self.slot(slot)?;
        let pos = st.pos;
        let parts = state_parts(st, &self.model.cfg, pos)?;
        let total: u64 = parts.iter().map(|(_, _, b)| b).sum();
        let gpu = &self.gpu;
        let buffer = gpu.buffer_zeroed(&format!("snapshot{idx}"), total.max(4))?;
        let mut rec = gpu.recorder();
        let mut at = 0;
        for (src, offset, bytes) in parts {
            if bytes > 0 {
                rec.copy(src, offset, &buffer, at, bytes)?;
            }
            at += bytes;
        }
        rec.submit()?;
        self.snapshots.insert(idx, Snapshot { pos, buffer });
        Ok(())
    }

    /// Restore snapshot `idx` into `slot` (its position becomes the snapshot's).
    pub fn state_load(&mut self, slot: usize, idx: u64) -> Result<()> {
        self.slot(slot)?;
        self.disarm()?;
        self.chain_from = None;
        let snap = self
            .snapshots
            .get(&idx)
            .ok_or_else(|| QkError::Engine(format!("no state snapshot {idx}")))?;
        let parts = state_parts(&self.slots[slot], &self.model.cfg, snap.pos)?;
        let mut rec = self.gpu.recorder();
        let mut at = 0;
        for (dst, offset, bytes) in parts {
            if bytes > 0 {
                rec.copy(&snap.buffer, at, dst, offset, bytes)?;
            }
            at += bytes;
        }
        rec.submit()?;
        self.slots[slot].pos = snap.pos;
        Ok(())
    }

    pub fn state_drop(&mut self, idx: u64) -> Result<()> {
        self.snapshots
            .remove(&idx)
            .map(|_| ())
            .ok_or_else(|| QkError::Engine(format!("no state snapshot {idx}")))
    }
}

fn no_arming() -> QkError {
    QkError::Engine("armed step on an engine without armed steps".into())
}

impl Drop for Engine {
    fn drop(&mut self) {
        // An armed submit left queued would hold the device forever: retire it; if that fails,
        // dropping the inputs lets it go on whatever they hold. The semaphore goes before the device.
        let _ = self.disarm();
        self.arming = None;
    }
}

/// One device per (adapter choice, subgroup setting) per process, shared by every engine on it:
/// pipelines are compiled once per process (lavapipe compiles slowly) and two stages in one
/// process (tests of split ≡ unsplit) see the same kernels.
fn shared_gpu(opts: &GpuOptions) -> Result<Arc<Gpu>> {
    type Key = (Option<String>, bool, bool);
    type Registry = Mutex<Vec<(Key, Weak<Gpu>)>>;
    static GPUS: OnceLock<Registry> = OnceLock::new();
    let key = (opts.device.clone(), opts.no_subgroups, opts.checked_shaders);
    let mut gpus = GPUS
        .get_or_init(|| Mutex::new(Vec::new()))
        .lock()
        .map_err(|_| QkError::Device("device registry poisoned".into()))?;
    gpus.retain(|(_, w)| w.strong_count() > 0);
    if let Some(gpu) = gpus
        .iter()
        .find(|(k, _)| *k == key)
        .and_then(|(_, w)| w.upgrade())
    {
        return Ok(gpu);
    }
    let gpu = Arc::new(Gpu::new(opts)?);
    gpus.push((key, Arc::downgrade(&gpu)));
    Ok(gpu)
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}
