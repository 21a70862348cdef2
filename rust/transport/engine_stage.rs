//! The native engine as a `Stage`: a worker serves it, and the head's pipeline runs its own layers
//! through it, with no Python between the socket and the GPU. The engine is shared (`Arc<Mutex>`)
//! with its Python handle, which keeps answering `info()` and the like between calls.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::engine::{Engine, StageInput, StageOutput};
use crate::error::{QkError, Result};
use crate::transport::messages::{HiddenRows, Rows, RunOut, StepEntry, StepOut};
use crate::transport::stage::{Stage, StageInfo};

/// Lock a shared engine. Poisoned means a call panicked while holding it: its GPU state is unknown,
/// so every later call refuses (the same words as the engine's Python handle).
pub fn lock_engine(engine: &Mutex<Engine>) -> Result<MutexGuard<'_, Engine>> {
    engine.lock().map_err(|_| {
        QkError::Engine("the engine failed in an earlier call (an internal error): load it again".into())
    })
}

/// The facts a hello states about a stage running `engine`: its layers, the model's shape, slots
/// and context, `snap_entries` snapshots of a whole slot state (KV + DeltaNet) each, the model
/// fingerprint and the adapter.
pub fn engine_info(engine: &Engine, fingerprint: &str, snap_entries: u32) -> StageInfo {
    let cfg = engine.config();
    let m = engine.memory();
    StageInfo {
        layer_first: engine.layers.0,
        layer_end: engine.layers.1,
        n_layer: cfg.n_layer,
        n_embd: cfg.n_embd,
        slots: engine.n_slots() as u32,
        ctx: engine.ctx(),
        snap_entries,
        snap_bytes: u64::from(snap_entries) * (m.kv_per_slot + m.deltanet_per_slot),
        fingerprint: fingerprint.to_string(),
        adapter: engine.gpu.adapter.name.clone(),
    }
}

pub struct EngineStage {
    engine: Arc<Mutex<Engine>>,
    info: StageInfo,
    /// Snapshot entries this stage saved: the engine has no cap on entries, so the stage refuses
    /// indices past the `snap_entries` it offers, and a new session drops exactly these.
    saved: BTreeSet<u32>,
}

impl EngineStage {
    pub fn new(engine: Arc<Mutex<Engine>>, fingerprint: &str, snap_entries: u32) -> Result<EngineStage> {
        let info = engine_info(&*lock_engine(&engine)?, fingerprint, snap_entries);
        Ok(EngineStage {
            engine,
            info,
            saved: BTreeSet::new(),
        })
    }

    fn engine(&self) -> Result<MutexGuard<'_, Engine>> {
        lock_engine(&self.engine)
    }
}

fn input(rows: &Rows) -> StageInput<'_> {
    match rows {
        Rows::Tokens(ids) => StageInput::Tokens(ids),
        Rows::Hidden(h) => StageInput::Hidden(&h.data),
    }
}

impl Stage for EngineStage {
    fn describe(&self) -> Result<StageInfo> {
        Ok(self.info.clone())
    }

    fn run(&mut self, slot: u32, base: u32, rows: &Rows, topk: u32) -> Result<RunOut> {
        let out = self.engine()?.stage_run(slot as usize, input(rows), base, topk)?;
        Ok(match out {
            StageOutput::Hidden(data) => RunOut::Hidden(HiddenRows {
                width: self.info.n_embd,
                data,
            }),
            StageOutput::Ids { ids, topk } => RunOut::Ids { ids, topk },
        })
    }

    fn step(&mut self, entries: &[StepEntry], rows: &Rows, topk: u32) -> Result<StepOut> {
        let mut engine = self.engine()?;
        let mut slots = Vec::with_capacity(entries.len());
        for e in entries {
            let position = engine.position(e.slot as usize)?;
            if e.base != position {
                return Err(QkError::Engine(format!(
                    "step: base {} for slot {}, which is at position {position}",
                    e.base, e.slot
                )));
            }
            slots.push(e.slot as usize);
        }
        // The same slots step after step, so the engine's step recorded ahead of this call serves it.
        let outs = engine.step(&slots, input(rows), topk)?;
        drop(engine);
        if !self.info.is_last() {
            let mut data = Vec::with_capacity(entries.len() * self.info.n_embd as usize);
            for out in outs {
                match out {
                    StageOutput::Hidden(row) => data.extend_from_slice(&row),
                    StageOutput::Ids { .. } => {
                        return Err(QkError::Engine(
                            "step: the engine answered ids on a stage that does not end the model".into(),
                        ));
                    }
                }
            }
            return Ok(StepOut::Hidden(HiddenRows {
                width: self.info.n_embd,
                data,
            }));
        }
        let (mut ids, mut tops) = (Vec::with_capacity(outs.len()), Vec::with_capacity(outs.len()));
        for out in outs {
            match out {
                StageOutput::Ids { ids: one, topk } if one.len() == 1 => {
                    ids.push(one[0]);
                    tops.push(topk);
                }
                _ => {
                    return Err(QkError::Engine(
                        "step: the engine did not answer one id per slot on the last stage".into(),
                    ));
                }
            }
        }
        Ok(StepOut::Ids { ids, topk: tops })
    }

    fn position(&self, slot: u32) -> Result<u32> {
        self.engine()?.position(slot as usize)
    }

    fn save(&mut self, slot: u32, idx: u32) -> Result<()> {
        if idx >= self.info.snap_entries {
            return Err(QkError::Engine(format!(
                "snapshot {idx} is past this stage's {} entries",
                self.info.snap_entries
            )));
        }
        self.engine()?.state_save(slot as usize, u64::from(idx))?;
        self.saved.insert(idx);
        Ok(())
    }

    fn load(&mut self, slot: u32, idx: u32) -> Result<()> {
        self.engine()?.state_load(slot as usize, u64::from(idx))
    }

    fn drop_snapshot(&mut self, idx: u32) -> Result<()> {
        // An entry never saved (or already dropped) is acknowledged: nothing is held for it.
        if self.saved.remove(&idx) {
            self.engine()?.state_drop(u64::from(idx))?;
        }
        Ok(())
    }

    fn reset(&mut self) -> Result<()> {
        // Slots reset themselves on their next base-0 run; snapshots must go now.
        let mut engine = lock_engine(&self.engine)?;
        while let Some(idx) = self.saved.pop_first() {
            engine.state_drop(u64::from(idx))?;
        }
        Ok(())
    }
}
