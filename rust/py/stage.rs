//! Python bindings of what runs a split's stages: `EngineStage` (a ``qk.Engine`` as the native
//! stage a worker serves, no Python per call), any Python object with the stage methods (the tests'
//! doubles), and `SplitHead`, the head's pipeline (its own layers, then the link thread), with the
//! `PendingStep` a decode step returns. Every wait releases the GIL.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use numpy::{PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use super::engine::PyEngine;
use super::errors::detach;
use super::transport::{
    Fields, PyHeadLink, STAGE_INFO_KEYS, TopK, hidden_array, lock, seconds, stage_dict, stage_info_from,
};
use crate::engine::Engine;
use crate::error::{QkError, Result};
use crate::transport::engine_stage::{EngineStage, engine_info, lock_engine};
use crate::transport::head::StepResult;
use crate::transport::messages::{HiddenRows, Rows, RunOut, StepEntry, StepOut};
use crate::transport::split_head::{ChainStatus, Pending, SplitConfig, SplitHead};
use crate::transport::stage::{Stage, StageInfo};

/// A ``qk.Engine`` as a pipeline stage: what ``qk._qk.Worker`` serves and a ``SplitHead`` runs
/// its own layers on, with no Python between the socket and the GPU. ``fingerprint`` is the model
/// file's (``qk.Gguf(path, header_only=True).fingerprint``); ``snapshots`` the state snapshot
/// entries the stage offers (indices past it are refused). ``describe()`` gives the hello's facts.
#[pyclass(name = "EngineStage", module = "qk._qk", frozen)]
pub(super) struct PyEngineStage {
    engine: Arc<Mutex<Engine>>,
    fingerprint: String,
    snapshots: u32,
}

impl PyEngineStage {
    fn stage(&self) -> Result<EngineStage> {
        EngineStage::new(Arc::clone(&self.engine), &self.fingerprint, self.snapshots)
    }
}

#[pymethods]
impl PyEngineStage {
    #[new]
    fn new(engine: &Bound<'_, PyEngine>, fingerprint: String, snapshots: u32) -> PyEngineStage {
        PyEngineStage {
            engine: engine.get().shared(),
            fingerprint,
            snapshots,
        }
    }

    /// The stage's facts as its hello states them (without name and boot_id).
    fn describe<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let info = {
            let engine = lock_engine(&self.engine)?;
            engine_info(&engine, &self.fingerprint, self.snapshots)
        };
        // A hello's stage description less what the worker adds (its name, the process's boot id).
        let d = stage_dict(py, &info.describe_as("", 0))?;
        d.del_item("name")?;
        d.del_item("boot_id")?;
        Ok(d)
    }
}

/// A Python object serving as a stage (the tests' doubles): ``describe() -> dict`` (the StageInfo
/// fields: layer_first, layer_end, n_layer, n_embd, slots, ctx, snap_entries, snap_bytes,
/// fingerprint, adapter); ``run(slot, base, tokens, hidden, topk)`` and ``step(entries, tokens,
/// hidden, topk)`` (``tokens`` a list of ids or None, ``hidden`` a 2-D float32 array or None)
/// returning a 2-D float32 array of hidden rows, or (ids, top-k) where run's top-k is [(id, logit)]
/// and step's one such list per entry; ``position(slot)``; ``save(slot, idx)``, ``load(slot, idx)``,
/// ``drop(idx)``, ``reset()``. Each call takes the GIL for its own length only; a Python exception
/// becomes the stage's error, sent to the head.
struct PyStage {
    obj: Py<PyAny>,
}

fn stage_error(py: Python<'_>, method: &str, e: PyErr) -> QkError {
    let detail = e
        .value(py)
        .str()
        .map_or_else(|_| "an exception".to_string(), |s| s.to_string());
    QkError::Engine(format!(
        "{method}: {}: {detail}",
        e.get_type(py)
            .name()
            .map_or_else(|_| "?".into(), |n| n.to_string())
    ))
}

impl PyStage {
    fn call<T>(
        &self,
        method: &str,
        build: impl for<'py> FnOnce(Python<'py>) -> PyResult<Bound<'py, PyTuple>>,
        read: impl for<'py> FnOnce(&Bound<'py, PyAny>) -> PyResult<T>,
    ) -> Result<T> {
        Python::attach(|py| {
            let args = build(py).map_err(|e| stage_error(py, method, e))?;
            let out = self
                .obj
                .bind(py)
                .call_method1(method, args)
                .map_err(|e| stage_error(py, method, e))?;
            read(&out).map_err(|e| stage_error(py, method, e))
        })
    }
}

fn input_args<'py>(py: Python<'py>, input: &Rows) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    match input {
        Rows::Tokens(ids) => Ok((PyList::new(py, ids)?.into_any(), py.None().into_bound(py))),
        Rows::Hidden(h) => Ok((py.None().into_bound(py), hidden_array(py, h)?)),
    }
}

fn hidden_out(out: &Bound<'_, PyAny>) -> PyResult<Option<HiddenRows>> {
    let Ok(array) = out.extract::<PyReadonlyArray2<'_, f32>>() else {
        return Ok(None);
    };
    let width = u32::try_from(array.shape()[1])
        .map_err(|_| PyValueError::new_err(format!("hidden rows of width {}", array.shape()[1])))?;
    Ok(Some(HiddenRows {
        width,
        data: array.as_array().iter().copied().collect(),
    }))
}

impl Stage for PyStage {
    fn describe(&self) -> Result<StageInfo> {
        self.call(
            "describe",
            |py| Ok(PyTuple::empty(py)),
            |out| {
                let d = out.cast::<PyDict>()?;
                stage_info_from(&Fields::new(d, "describe", &STAGE_INFO_KEYS)?)
            },
        )
    }

    fn run(&mut self, slot: u32, base: u32, input: &Rows, topk: u32) -> Result<RunOut> {
        self.call(
            "run",
            |py| {
                let (tokens, hidden) = input_args(py, input)?;
                (slot, base, tokens, hidden, topk).into_pyobject(py)
            },
            |out| {
                if let Some(h) = hidden_out(out)? {
                    return Ok(RunOut::Hidden(h));
                }
                let (ids, topk): (Vec<u32>, Vec<(u32, f32)>) = out.extract()?;
                Ok(RunOut::Ids { ids, topk })
            },
        )
    }

    fn step(&mut self, entries: &[StepEntry], input: &Rows, topk: u32) -> Result<StepOut> {
        self.call(
            "step",
            |py| {
                let pairs: Vec<(u32, u32)> = entries.iter().map(|e| (e.slot, e.base)).collect();
                let (tokens, hidden) = input_args(py, input)?;
                (pairs, tokens, hidden, topk).into_pyobject(py)
            },
            |out| {
                if let Some(h) = hidden_out(out)? {
                    return Ok(StepOut::Hidden(h));
                }
                let (ids, topk): (Vec<u32>, Vec<Vec<(u32, f32)>>) = out.extract()?;
                Ok(StepOut::Ids { ids, topk })
            },
        )
    }

    fn position(&self, slot: u32) -> Result<u32> {
        self.call(
            "position",
            |py| (slot,).into_pyobject(py),
            |out| out.extract::<u32>(),
        )
    }

    fn save(&mut self, slot: u32, idx: u32) -> Result<()> {
        self.call("save", |py| (slot, idx).into_pyobject(py), |_| Ok(()))
    }

    fn load(&mut self, slot: u32, idx: u32) -> Result<()> {
        self.call("load", |py| (slot, idx).into_pyobject(py), |_| Ok(()))
    }

    fn drop_snapshot(&mut self, idx: u32) -> Result<()> {
        self.call("drop", |py| (idx,).into_pyobject(py), |_| Ok(()))
    }

    fn reset(&mut self) -> Result<()> {
        self.call("reset", |py| Ok(PyTuple::empty(py)), |_| Ok(()))
    }
}

/// The stage behind ``obj``: an ``EngineStage`` (native), or a Python object with every stage method.
pub(super) fn stage_of(obj: &Bound<'_, PyAny>) -> PyResult<Box<dyn Stage + Send>> {
    if let Ok(native) = obj.cast::<PyEngineStage>() {
        return Ok(Box::new(native.get().stage()?));
    }
    for m in [
        "describe", "run", "step", "position", "save", "load", "drop", "reset",
    ] {
        if !obj.hasattr(m)? {
            return Err(PyTypeError::new_err(format!(
                "a stage needs a {m}() method; {} has none (serve a qk.Engine as qk._qk.EngineStage)",
                obj.get_type().name()?
            )));
        }
    }
    Ok(Box::new(PyStage {
        obj: obj.clone().unbind(),
    }))
}

/// A decode step handed to the chain: ``result()`` waits for the chain's answer, (ids, top-k lists),
/// once; ``done()`` says whether it has come.
#[pyclass(name = "PendingStep", module = "qk._qk", frozen)]
struct PyPendingStep {
    state: Mutex<Waiting>,
}

enum Waiting {
    Pending(Pending<StepResult>),
    Ready(Result<StepResult>),
    Taken,
}

#[pymethods]
impl PyPendingStep {
    fn done(&self) -> bool {
        let mut state = lock(&self.state);
        if let Waiting::Pending(_) = &*state {
            let Waiting::Pending(p) = std::mem::replace(&mut *state, Waiting::Taken) else {
                return false;
            };
            *state = match p.try_wait() {
                Ok(r) => Waiting::Ready(r),
                Err(p) => Waiting::Pending(p),
            };
        }
        !matches!(&*state, Waiting::Pending(_))
    }

    fn result(&self, py: Python<'_>) -> PyResult<(Vec<u32>, Vec<TopK>)> {
        let state = std::mem::replace(&mut *lock(&self.state), Waiting::Taken);
        let out = detach(py, || match state {
            Waiting::Pending(p) => p.wait(),
            Waiting::Ready(r) => r,
            Waiting::Taken => Err(QkError::Transport("this step's result was already taken".into())),
        })?;
        Ok((out.ids, out.topk))
    }
}

/// The head of a split: ``stage`` runs layers [0, a) — a ``qk.Engine`` (served natively, with the
/// fingerprint and snapshot entries of ``link``'s own description), an ``EngineStage``, or a Python
/// stage object — and ``link`` (a ``HeadLink``) reaches the rest. Calls to the chain run in order on
/// one link thread: ``prefill`` cuts a prompt at absolute multiples of ``piece`` and sends each
/// piece's rows while the next is computed; ``step`` runs the head's layers now and returns a
/// ``PendingStep``. While idle for ``tick`` seconds (None: never) the link thread reconnects a down
/// link after its backoff, takes in a takeover notice, and pings a chain idle for ``ping_idle``.
/// ``status()`` never waits for a call in flight. Chain failures raise ``qk.TransportError``
/// ("pipeline stage failed: …"); the head's own, its engine's error.
#[pyclass(name = "SplitHead", module = "qk._qk", frozen)]
struct PySplitHead {
    head: SplitHead,
}

fn seconds_or_none(d: Option<Duration>) -> Option<f64> {
    d.map(|d| d.as_secs_f64())
}

fn status_dict<'py>(py: Python<'py>, st: &ChainStatus) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("up", st.up)?;
    d.set_item("sessions", st.sessions)?;
    let chain = PyList::empty(py);
    for s in &st.chain {
        chain.append(stage_dict(py, s)?)?;
    }
    d.set_item("chain", chain)?;
    d.set_item("snapshot_entries", st.snapshot_entries)?;
    d.set_item("last_error", &st.last_error)?;
    let now = Instant::now();
    d.set_item(
        "retry_in",
        st.retry_at
            .map(|at| at.saturating_duration_since(now).as_secs_f64()),
    )?;
    d.set_item("taken_over", &st.taken_over)?;
    d.set_item("ping_seconds", seconds_or_none(st.ping))?;
    d.set_item("step_rtt_seconds", seconds_or_none(st.step_rtt))?;
    let t = PyDict::new(py);
    t.set_item("steps", st.totals.steps)?;
    t.set_item("rows", st.totals.rows)?;
    t.set_item("head_seconds", st.totals.head.as_secs_f64())?;
    t.set_item("queued_seconds", st.totals.queued.as_secs_f64())?;
    t.set_item("chain_seconds", st.totals.chain.as_secs_f64())?;
    d.set_item("steps", t)?;
    Ok(d)
}

#[pymethods]
impl PySplitHead {
    #[new]
    #[pyo3(signature = (stage, link, *, piece=128, tick=Some(1.0), ping_idle=5.0))]
    fn new(
        stage: &Bound<'_, PyAny>,
        link: &Bound<'_, PyHeadLink>,
        piece: u32,
        tick: Option<f64>,
        ping_idle: f64,
    ) -> PyResult<PySplitHead> {
        let shared = link.get().shared();
        let stage = match stage.cast::<PyEngine>() {
            Ok(engine) => {
                let own = lock(&shared).config().own.clone();
                Box::new(EngineStage::new(
                    engine.get().shared(),
                    &own.fingerprint,
                    own.snap_entries,
                )?)
            }
            Err(_) => stage_of(stage)?,
        };
        let cfg = SplitConfig {
            piece,
            tick: tick.map(|t| seconds("tick", t)).transpose()?,
            ping_idle: seconds("ping_idle", ping_idle)?,
        };
        Ok(PySplitHead {
            head: SplitHead::new(stage, shared, cfg)?,
        })
    }

    /// Connect and hello now (ending a live session first); the chain after the head.
    fn connect<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let chain = detach(py, || self.head.connect())?;
        chain.iter().map(|s| stage_dict(py, s)).collect()
    }

    /// Positions [base, base + len(tokens)) of ``slot``: (the chain's greedy ids of the final
    /// piece, the final position's top-k pairs).
    #[pyo3(signature = (slot, tokens, base, topk=0))]
    fn prefill(
        &self,
        py: Python<'_>,
        slot: u32,
        tokens: Vec<u32>,
        base: u32,
        topk: u32,
    ) -> PyResult<(Vec<u32>, TopK)> {
        let out = detach(py, || self.head.prefill(slot, &tokens, base, topk))?;
        Ok((out.ids, out.topk))
    }

    /// One decode position for each slot (distinct), one token each: the head's layers run now;
    /// the returned ``PendingStep`` gives the chain's (ids, top-k lists).
    #[pyo3(signature = (slots, tokens, topk=0))]
    fn step(&self, py: Python<'_>, slots: Vec<u32>, tokens: Vec<u32>, topk: u32) -> PyResult<PyPendingStep> {
        let pending = detach(py, || self.head.step(&slots, &tokens, topk))?;
        Ok(PyPendingStep {
            state: Mutex::new(Waiting::Pending(pending)),
        })
    }

    /// The step after the latest one over the same ``slots`` (no other call between), each slot fed
    /// the chain's greedy id for it: the head's layers run on the link thread once that answer is
    /// in. The ``PendingStep`` fails if the step before it failed.
    #[pyo3(signature = (slots, topk=0))]
    fn step_chained(&self, py: Python<'_>, slots: Vec<u32>, topk: u32) -> PyResult<PyPendingStep> {
        let pending = detach(py, || self.head.step_chained(&slots, topk))?;
        Ok(PyPendingStep {
            state: Mutex::new(Waiting::Pending(pending)),
        })
    }

    /// Snapshot ``slot`` into entry ``idx`` on the head, then on every stage of the chain.
    fn save(&self, py: Python<'_>, slot: u32, idx: u32) -> PyResult<()> {
        detach(py, || self.head.save(slot, idx))
    }

    fn load(&self, py: Python<'_>, slot: u32, idx: u32) -> PyResult<()> {
        detach(py, || self.head.load(slot, idx))
    }

    /// Free entry ``idx`` on the head and (while the link is up) on the chain.
    fn drop(&self, py: Python<'_>, idx: u32) -> PyResult<()> {
        detach(py, || self.head.drop_snapshot(idx))
    }

    /// The link as of its latest call or tick: up, sessions, chain, snapshot_entries, last_error,
    /// retry_in, taken_over, ping_seconds, step_rtt_seconds, and ``steps`` — decode steps summed
    /// (steps, rows, head_seconds, queued_seconds, chain_seconds). Never waits for a call.
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        status_dict(py, &self.head.status())
    }

    /// Sessions established so far; never waits for a call.
    #[getter]
    fn sessions(&self) -> u64 {
        self.head.sessions()
    }

    /// Names of the stages that restarted (changed boot id) at a reconnect since the last call.
    fn take_restarted(&self) -> Vec<String> {
        self.head.take_restarted()
    }

    /// End the session cleanly after the calls already handed over; later calls raise.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        detach(py, || {
            self.head.close();
            Ok(())
        })
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEngineStage>()?;
    m.add_class::<PySplitHead>()?;
    m.add_class::<PyPendingStep>()?;
    Ok(())
}
