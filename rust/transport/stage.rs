//! What a stage needs from its local engine (`Stage`): the facts its hello describes, the forward
//! pass over its layers for one slot (`run`) or one position of several slots (`step`), slot
//! positions and the snapshot operations. The worker's serve loop (`worker.rs`) and the head's
//! pipeline (`split_head.rs`) are written against this trait only, so the native engine
//! (`engine_stage.rs`) and test doubles (Rust, or a Python object through the bindings) serve alike.

use crate::error::Result;
use crate::transport::hello::StageDesc;
use crate::transport::messages::{Rows, RunOut, StepEntry, StepOut};

/// The facts about a stage that only its engine knows. The worker adds its name and boot id to make
/// the `StageDesc` its hello sends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageInfo {
    /// The stage runs layers [layer_first, layer_end) of n_layer.
    pub layer_first: u32,
    pub layer_end: u32,
    pub n_layer: u32,
    pub n_embd: u32,
    pub slots: u32,
    /// Context positions per slot.
    pub ctx: u32,
    /// Snapshot capacity: entries, and bytes of state those entries may hold.
    pub snap_entries: u32,
    pub snap_bytes: u64,
    /// Hash of the model file's header and tensor table.
    pub fingerprint: String,
    /// The GPU adapter the stage runs on.
    pub adapter: String,
}

impl StageInfo {
    /// The hello's description of this stage under `name`, for this process start (`boot_id`).
    pub fn describe_as(&self, name: &str, boot_id: u64) -> StageDesc {
        StageDesc {
            name: name.to_string(),
            boot_id,
            layer_first: self.layer_first,
            layer_end: self.layer_end,
            n_layer: self.n_layer,
            n_embd: self.n_embd,
            slots: self.slots,
            ctx: self.ctx,
            snap_entries: self.snap_entries,
            snap_bytes: self.snap_bytes,
            fingerprint: self.fingerprint.clone(),
            adapter: self.adapter.clone(),
        }
    }

    /// Whether this stage ends the model (runs the final norm and LM head and so answers ids).
    pub fn is_last(&self) -> bool {
        self.layer_end == self.n_layer
    }
}

/// A stage's local engine. Errors are returned, never panicked: the worker sends them to the head as
/// an ERROR with this stage's name, and the session goes on.
pub trait Stage {
    /// The stage's fixed facts; called once when the worker starts.
    fn describe(&self) -> Result<StageInfo>;

    /// Positions [base, base + n) of `slot` through this stage's layers. `base == 0` resets the slot;
    /// any other base must equal the slot's position. `input` is token ids (a stage that embeds) or
    /// n hidden rows of n_embd. A non-last stage answers `RunOut::Hidden` with n rows; the last stage
    /// answers n greedy ids and, when `topk > 0`, the top-k (id, logit) pairs of the final position.
    fn run(&mut self, slot: u32, base: u32, input: &Rows, topk: u32) -> Result<RunOut>;

    /// One decode position for each entry (`input` has one row per entry, in entry order), in one pass.
    /// A non-last stage answers one hidden row per entry; the last one id and its top-k per entry.
    fn step(&mut self, entries: &[StepEntry], input: &Rows, topk: u32) -> Result<StepOut>;

    /// Positions `slot` has run (the base its next STEP entry must carry).
    fn position(&self, slot: u32) -> Result<u32>;

    /// Snapshot `slot`'s whole state into entry `idx`, restore it, or free entry `idx`.
    fn save(&mut self, slot: u32, idx: u32) -> Result<()>;
    fn load(&mut self, slot: u32, idx: u32) -> Result<()>;
    fn drop_snapshot(&mut self, idx: u32) -> Result<()>;

    /// A new head session begins: forget every slot's position and drop every snapshot.
    fn reset(&mut self) -> Result<()>;
}
