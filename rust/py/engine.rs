//! Python bindings of the engine: `_qk.Engine` (NumPy in and out; the GIL is released while the
//! GPU works).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray2};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use super::errors::detach;
use crate::engine::{
    Engine, EngineOptions, OpProfile, StageInput, StageOutput, StepFeed, StepProfile, StepTiming,
};
use crate::ops::attention::{DecodeTuning, KvType};
use crate::ops::matmul::{Iq4Lookup, MatvecShape};
use crate::transport::engine_stage::lock_engine;

/// A model (or a layer range of it) loaded on one GPU, with `slots` independent sequences of up to
/// `ctx` positions each. `precise=True` keeps every product in f32 and the KV cache in f32 (the
/// float64-reference gates); the default runs prefill mat-mats on tensor cores (f16 inputs) where
/// the adapter has them and keeps an f16 cache. `cache_type_k` ("f16", "q8_0" or "f32") and
/// `cache_type_v` ("f16" or "f32") override the cache element types. `prefill_rows` (a multiple of
/// 64) sets the positions per prefill piece; by default 2048 on a discrete GPU where the scratch
/// fits, else 512. The results are the same whatever it is; the scratch grows with it.
/// `route_inside_max_rows`: decode steps of at most that many slots route their tokens inside the
/// experts' gate/up product, larger ones run the router kernel first (default 1: one slot routes
/// inside); the same results either way, a speed choice a bench can compare. `attention_walk`
/// `(columns, keys per column, shortest split[, lanes per key])`: how decode attention walks a row's
/// keys (default (4, 4, 32, 32)); a speed choice too, though it changes attention's last bits.
/// `dense_group_cols` (1–8): columns one workgroup of a decode step's dense mat-vecs takes at most,
/// a step of more slots splitting them into groups (default 4); a speed choice with the same bytes.
/// `decode_shapes` `{op: (rows, width, steps, column groups[, "table" | "shuffle"])}`: the launch
/// shape of a decode step's mat-vecs by profile op name ("dn.qkvz", "attn.qkv", "moe.router_mv",
/// "dn.out", "moe.gate_up", "moe.down", ...; the last value: where IQ4_XS values are looked up), at
/// every slot count: for benches comparing shapes in the engine; it changes those ops' last bits.
/// `spin_wait_us`: how long a decode step's wait for the GPU polls without sleeping before it
/// blocks (default 20,000 on a GPU, 0 on a CPU adapter); a speed choice with the same bytes.
/// `weight_arena` (default True): small weight tensors as ranges of a few shared buffers (fewer
/// buffers for wgpu's submit to track each step); the same bytes either way.
/// `armed_steps` (default False; Vulkan, else ignored): each host-fed decode step (`step`, or
/// `step_submit` of rows with `chain_next` false) submits the likely next one too, held on the GPU
/// until the next call's input lands in mapped memory, so that call's submit is off the path from
/// input to GPU (a device of its own, one spare slot of DeltaNet state); the same bytes either way.
/// `tensor_core_decode_cols` (2–16; default None: never): decode steps of at least that many slots
/// run the mixers' dense products on tensor cores where the adapter has cooperative matrices (f16
/// inputs; a fast engine only): gives such a step's slots other bytes than each would get stepping
/// alone, and as built it is slower (H200: half the 8-slot rate; benches/RESULTS.md).
///
/// >>> eng = Engine("model.gguf", slots=2, ctx=4096)
/// >>> eng.generate([1, 2, 3], max_new=8)
#[pyclass(name = "Engine", module = "qk._qk", frozen)]
pub struct PyEngine {
    /// Shared with the native stage that serves it (a worker's, or a split head's own layers), so
    /// no Python sits between the socket and the GPU while this handle still answers `info()`.
    inner: Arc<Mutex<Engine>>,
    n_embd: usize,
}

/// Token ids, or hidden rows (a 2-D float32 array of n_embd columns).
enum Rows {
    Tokens(Vec<u32>),
    Hidden(Vec<f32>),
}

impl Rows {
    fn extract(obj: &Bound<'_, PyAny>) -> PyResult<Rows> {
        if let Ok(a) = obj.extract::<PyReadonlyArray2<'_, f32>>() {
            return Ok(Rows::Hidden(a.as_array().iter().copied().collect()));
        }
        if obj.extract::<PyReadonlyArray2<'_, f64>>().is_ok() {
            return Err(PyTypeError::new_err(
                "hidden rows must be float32 [n, n_embd], not float64",
            ));
        }
        Ok(Rows::Tokens(obj.extract::<Vec<u32>>()?))
    }

    fn input(&self) -> StageInput<'_> {
        match self {
            Rows::Tokens(t) => StageInput::Tokens(t),
            Rows::Hidden(h) => StageInput::Hidden(h),
        }
    }
}

impl PyEngine {
    fn lock(&self) -> crate::Result<std::sync::MutexGuard<'_, Engine>> {
        // Poisoned: a call panicked while holding the engine (answered as qk.InternalError); its
        // GPU state is unknown, so every later call refuses.
        lock_engine(&self.inner)
    }

    /// The engine itself, for a native stage to serve.
    pub(crate) fn shared(&self) -> Arc<Mutex<Engine>> {
        Arc::clone(&self.inner)
    }

    /// Run `f` on the engine with the GIL released (the lock is taken without the GIL, so a
    /// second Python thread waiting on it cannot deadlock the first); a panic is qk.InternalError.
    fn detached<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Engine) -> crate::Result<R> + Send,
    ) -> PyResult<R> {
        detach(py, || f(&mut *self.lock()?))
    }

    fn output<'py>(&self, py: Python<'py>, out: StageOutput) -> PyResult<Bound<'py, PyAny>> {
        Ok(match out {
            StageOutput::Hidden(h) => {
                let rows = h.len() / self.n_embd.max(1);
                PyArray1::from_vec(py, h).reshape([rows, self.n_embd])?.into_any()
            }
            StageOutput::Ids { ids, topk } => {
                let ids = PyList::new(py, ids)?;
                let top = PyList::new(py, topk)?;
                PyTuple::new(py, [ids.into_any(), top.into_any()])?.into_any()
            }
        })
    }

    /// One `output` per slot of a step, as a list.
    fn outputs<'py>(&self, py: Python<'py>, outs: Vec<StageOutput>) -> PyResult<Bound<'py, PyList>> {
        let items = outs
            .into_iter()
            .map(|o| self.output(py, o))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)
    }
}

#[pymethods]
impl PyEngine {
    #[new]
    #[pyo3(signature = (path, layers = None, slots = 1, ctx = 4096, device = None, precise = false, cache_type_k = None, cache_type_v = None, prefill_rows = None, route_inside_max_rows = None, attention_walk = None, dense_group_cols = None, decode_shapes = None, spin_wait_us = None, weight_arena = None, armed_steps = None, tensor_core_decode_cols = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: String,
        layers: Option<(u32, u32)>,
        slots: u32,
        ctx: u32,
        device: Option<String>,
        precise: bool,
        cache_type_k: Option<String>,
        cache_type_v: Option<String>,
        prefill_rows: Option<u32>,
        route_inside_max_rows: Option<u32>,
        attention_walk: Option<Vec<u32>>,
        dense_group_cols: Option<u32>,
        decode_shapes: Option<BTreeMap<String, Bound<'_, PyAny>>>,
        spin_wait_us: Option<i64>,
        weight_arena: Option<bool>,
        armed_steps: Option<bool>,
        tensor_core_decode_cols: Option<u32>,
    ) -> PyResult<Self> {
        let parse = |t: Option<String>| t.map(|t| KvType::parse(&t)).transpose();
        let opts = EngineOptions {
            layers,
            slots,
            ctx,
            device,
            precise,
            cache_type_k: parse(cache_type_k)?,
            cache_type_v: parse(cache_type_v)?,
            prefill_rows,
            route_inside_max_rows,
            attention_walk: attention_walk.map(walk_from).transpose()?,
            dense_group_cols,
            decode_shapes: decode_shapes
                .unwrap_or_default()
                .into_iter()
                .map(|(op, shape)| Ok((op, shape_from(&shape)?)))
                .collect::<PyResult<_>>()?,
            spin_wait: spin_wait_us
                .map(|us| {
                    u64::try_from(us)
                        .map(std::time::Duration::from_micros)
                        .map_err(|_| {
                            crate::QkError::Engine(format!("spin_wait_us must be 0 or more, not {us}"))
                        })
                })
                .transpose()?,
            weight_arena,
            armed_steps,
            tensor_core_decode_cols,
        };
        let engine = detach(py, || {
            Engine::load(&path, &opts, &mut |line| {
                eprintln!("qk: {line}");
            })
        })?;
        let n_embd = engine.config().n_embd as usize;
        Ok(PyEngine {
            inner: Arc::new(Mutex::new(engine)),
            n_embd,
        })
    }

    /// Greedy continuation of `tokens` (run from position 0 of `slot`): `max_new` new ids.
    #[pyo3(signature = (tokens, max_new, slot = 0))]
    fn generate(&self, py: Python<'_>, tokens: Vec<u32>, max_new: usize, slot: usize) -> PyResult<Vec<u32>> {
        self.detached(py, |eng| eng.generate(slot, &tokens, max_new))
    }

    /// Run positions [base, base + n) of `slot`. `inputs`: token ids (first stage) or float32 hidden
    /// rows [n, n_embd]. Returns hidden rows [n, n_embd] (non-last stage) or (ids of every
    /// position, top-k (id, logit) pairs of the final position); with `all_ids=False` the ids are
    /// the final position's alone (the same bytes), and the LM head skips the other rows.
    #[pyo3(signature = (slot, inputs, base, topk = 0, all_ids = true))]
    fn stage_run<'py>(
        &self,
        py: Python<'py>,
        slot: usize,
        inputs: &Bound<'py, PyAny>,
        base: u32,
        topk: u32,
        all_ids: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let rows = Rows::extract(inputs)?;
        let out = self.detached(py, |eng| {
            if all_ids {
                eng.stage_run(slot, rows.input(), base, topk)
            } else {
                eng.stage_run_last(slot, rows.input(), base, topk)
            }
        })?;
        self.output(py, out)
    }

    /// One decode position for each slot in `slots`; `inputs` one token id (or hidden row) per
    /// slot. Returns a list with one stage_run-style result per slot.
    #[pyo3(signature = (slots, inputs, topk = 0))]
    fn step<'py>(
        &self,
        py: Python<'py>,
        slots: Vec<usize>,
        inputs: &Bound<'py, PyAny>,
        topk: u32,
    ) -> PyResult<Bound<'py, PyList>> {
        let rows = Rows::extract(inputs)?;
        let outs = self.detached(py, |eng| eng.step(&slots, rows.input(), topk))?;
        self.outputs(py, outs)
    }

    /// Submit one decode step without waiting; returns its id for `step_collect`. `inputs`: one
    /// token id (or hidden row) per slot, or None to take each slot's token from the previous step
    /// over the same slots, on the GPU (its greedy id; that step may still be running: first and
    /// last stage only, nothing run between the two). `chain_next=True` records a chained step
    /// ahead as the likely next call.
    #[pyo3(signature = (slots, inputs, topk = 0, chain_next = false))]
    fn step_submit(
        &self,
        py: Python<'_>,
        slots: Vec<usize>,
        inputs: Option<&Bound<'_, PyAny>>,
        topk: u32,
        chain_next: bool,
    ) -> PyResult<u64> {
        let rows = inputs.map(Rows::extract).transpose()?;
        self.detached(py, |eng| {
            let feed = rows
                .as_ref()
                .map_or(StepFeed::Chained, |r| StepFeed::Rows(r.input()));
            eng.step_submit(&slots, feed, topk, chain_next)
        })
    }

    /// Wait for the step `id` of `step_submit` and return what `step` would have (steps submitted
    /// before it and not collected are dropped).
    fn step_collect<'py>(&self, py: Python<'py>, id: u64) -> PyResult<Bound<'py, PyList>> {
        let outs = self.detached(py, |eng| eng.step_collect(id))?;
        self.outputs(py, outs)
    }

    /// `step` with every dispatch labelled and, where the adapter has timestamp queries, timed on
    /// the GPU (one pass per dispatch; the same results as `step`). Returns a dict:
    /// `outputs` (as `step`), `dispatches` (one dict per dispatch in order: op, layer, kernel,
    /// groups, gpu_us), `ops` (per op instance: op, layer, kernels, dispatches, gpu_us, bytes,
    /// gb_s), `families` (the same aggregated over layers, most GPU time first) and `step`
    /// (rows, timestamps, dispatches/submits/readbacks and what the step created, GPU busy and
    /// span µs, host µs of this step and of the last unprofiled step). gpu_us is None where the
    /// adapter has no timestamps: nothing is estimated.
    #[pyo3(signature = (slots, inputs, topk = 0))]
    fn profile_step<'py>(
        &self,
        py: Python<'py>,
        slots: Vec<usize>,
        inputs: &Bound<'py, PyAny>,
        topk: u32,
    ) -> PyResult<Bound<'py, PyDict>> {
        let rows = Rows::extract(inputs)?;
        let (outs, prof) = self.detached(py, |eng| eng.profile_step(&slots, rows.input(), topk))?;
        let d = PyDict::new(py);
        d.set_item("outputs", self.outputs(py, outs)?)?;
        fill_profile(py, &d, &prof)?;
        Ok(d)
    }

    /// `stage_run` profiled like `profile_step` (every prefill piece's dispatches in one profile,
    /// host times summed over the pieces; `normal` is None). The result is under `output`.
    #[pyo3(signature = (slot, inputs, base, topk = 0))]
    fn profile_stage_run<'py>(
        &self,
        py: Python<'py>,
        slot: usize,
        inputs: &Bound<'py, PyAny>,
        base: u32,
        topk: u32,
    ) -> PyResult<Bound<'py, PyDict>> {
        let rows = Rows::extract(inputs)?;
        let (out, prof) = self.detached(py, |eng| eng.profile_stage_run(slot, rows.input(), base, topk))?;
        let d = PyDict::new(py);
        d.set_item("output", self.output(py, out)?)?;
        fill_profile(py, &d, &prof)?;
        Ok(d)
    }

    /// Host µs of the last `step` (rows, record_us, submit_us, wait_us, total_us), or None.
    fn last_step_timing<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let t = self.lock()?.last_step_timing();
        t.map(|t| timing_dict(py, &t)).transpose()
    }

    /// Every decode step's host timing summed since load: steps, ahead (steps recorded while the
    /// one before ran), rows, record_us (ahead_record_us: of the steps recorded ahead alone),
    /// submit_us, wait_us, total_us; a run's means are the difference of two readings divided by
    /// its steps.
    fn step_totals<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let t = self.lock()?.step_totals();
        let d = PyDict::new(py);
        d.set_item("steps", t.steps)?;
        d.set_item("ahead", t.ahead)?;
        d.set_item("rows", t.rows)?;
        d.set_item("record_us", t.record_us)?;
        d.set_item("ahead_record_us", t.ahead_record_us)?;
        d.set_item("submit_us", t.submit_us)?;
        d.set_item("wait_us", t.wait_us)?;
        d.set_item("total_us", t.total_us)?;
        Ok(d)
    }

    /// Logits [n, vocab] (float32) of positions [base, base + n) of `slot` (tests).
    #[pyo3(signature = (slot, tokens, base = 0))]
    fn logits<'py>(
        &self,
        py: Python<'py>,
        slot: usize,
        tokens: Vec<u32>,
        base: u32,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let (values, vocab) = self.detached(py, |eng| {
            Ok((eng.logits(slot, &tokens, base)?, eng.config().vocab as usize))
        })?;
        let rows = values.len() / vocab.max(1);
        PyArray1::from_vec(py, values).reshape([rows, vocab])
    }

    /// The position (tokens run so far) of `slot`.
    fn position(&self, slot: usize) -> PyResult<u32> {
        Ok(self.lock()?.position(slot)?)
    }

    fn state_save(&self, py: Python<'_>, slot: usize, idx: u64) -> PyResult<()> {
        self.detached(py, |eng| eng.state_save(slot, idx))
    }

    fn state_load(&self, py: Python<'_>, slot: usize, idx: u64) -> PyResult<()> {
        self.detached(py, |eng| eng.state_load(slot, idx))
    }

    fn state_drop(&self, idx: u64) -> PyResult<()> {
        Ok(self.lock()?.state_drop(idx)?)
    }

    /// arch, layers, n_layer, n_embd, vocab, slots, ctx, prefill_rows, spin_wait_us, weight_arena,
    /// armed_steps (whether they are on), adapter,
    /// cache_type_k, cache_type_v,
    /// memory (bytes; kv_per_slot is every local attention layer's K and V at full ctx).
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let eng = self.lock()?;
        let cfg = eng.config();
        let d = PyDict::new(py);
        d.set_item("arch", cfg.arch.name())?;
        d.set_item("layers", eng.layers)?;
        d.set_item("n_layer", cfg.n_layer)?;
        d.set_item("n_mtp_skipped", cfg.n_mtp)?;
        d.set_item("n_embd", cfg.n_embd)?;
        d.set_item("vocab", cfg.vocab)?;
        d.set_item("slots", eng.n_slots())?;
        d.set_item("ctx", eng.ctx())?;
        d.set_item("prefill_rows", eng.prefill_rows())?;
        d.set_item("spin_wait_us", eng.spin_wait().as_micros() as u64)?;
        d.set_item("weight_arena", eng.weight_arena())?;
        d.set_item("armed_steps", eng.armed_steps())?;
        d.set_item("tensor_core_decode_cols", eng.tensor_core_decode_cols())?;
        d.set_item("adapter", eng.gpu.adapter.name.clone())?;
        d.set_item("unchecked_shaders", eng.gpu.unchecked_shaders)?;
        let (k_type, v_type) = eng.kv_types();
        d.set_item("cache_type_k", k_type.name())?;
        d.set_item("cache_type_v", v_type.name())?;
        let m = eng.memory();
        let mem = PyDict::new(py);
        mem.set_item("weights", m.weights)?;
        mem.set_item("kv_per_slot", m.kv_per_slot)?;
        mem.set_item("deltanet_per_slot", m.deltanet_per_slot)?;
        mem.set_item("scratch", m.scratch)?;
        mem.set_item("snapshots", m.snapshots)?;
        mem.set_item("total", m.total)?;
        d.set_item("memory", mem)?;
        Ok(d)
    }

    /// Cumulative GPU counters: pipelines, bind_groups, buffers, submits, readbacks, dispatches,
    /// spun_waits (waits that saw the GPU finish while polling, see `spin_wait_us`), writes (queue
    /// writes into GPU buffers: a decode step's inputs).
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.lock()?.counters();
        let d = PyDict::new(py);
        d.set_item("pipelines", c.pipelines)?;
        d.set_item("bind_groups", c.bind_groups)?;
        d.set_item("buffers", c.buffers)?;
        d.set_item("submits", c.submits)?;
        d.set_item("readbacks", c.readbacks)?;
        d.set_item("dispatches", c.dispatches)?;
        d.set_item("spun_waits", c.spun_waits)?;
        d.set_item("writes", c.writes)?;
        Ok(d)
    }
}

/// The profile's `dispatches`, `ops`, `families` and `step` entries (see `Engine.profile_step`).
/// `attention_walk`'s (columns, keys per column, shortest split[, lanes per key]).
/// A `decode_shapes` value: (rows, width, steps, column groups[, "table" | "shuffle"]).
fn shape_from(v: &Bound<'_, PyAny>) -> PyResult<MatvecShape> {
    let (rows, wg, unroll, groups, lookup) = match v.extract::<(u32, u32, u32, u32)>() {
        Ok((rows, wg, unroll, groups)) => (rows, wg, unroll, groups, "table".to_string()),
        Err(_) => v.extract::<(u32, u32, u32, u32, String)>().map_err(|_| {
            PyTypeError::new_err(
                "decode_shapes: each value is (rows, width, steps, column groups[, \"table\" | \"shuffle\"])",
            )
        })?,
    };
    let lookup = match lookup.as_str() {
        "table" => Iq4Lookup::Table,
        "shuffle" => Iq4Lookup::Shuffle,
        other => {
            return Err(crate::QkError::Engine(format!(
                "decode_shapes: the IQ4_XS lookup is \"table\" or \"shuffle\", not {other:?}"
            ))
            .into());
        }
    };
    let shape = MatvecShape::new(rows, wg, unroll).with_col_groups(groups);
    Ok(shape.with_lookup(lookup))
}

fn walk_from(v: Vec<u32>) -> Result<DecodeTuning, crate::QkError> {
    match v[..] {
        [cols, unroll, min_split] => Ok(DecodeTuning {
            cols,
            unroll,
            min_split,
            ..DecodeTuning::DEFAULT
        }),
        [cols, unroll, min_split, lanes] => Ok(DecodeTuning {
            cols,
            unroll,
            min_split,
            lanes,
        }),
        _ => Err(crate::QkError::Engine(format!(
            "attention walk: 3 or 4 values (columns, keys per column, shortest split[, lanes per key]), got {}",
            v.len()
        ))),
    }
}

fn fill_profile<'py>(py: Python<'py>, d: &Bound<'py, PyDict>, prof: &StepProfile) -> PyResult<()> {
    let mut dispatches = Vec::new();
    for x in &prof.submit.dispatches {
        let e = PyDict::new(py);
        e.set_item("op", x.op.op)?;
        e.set_item("layer", x.op.layer)?;
        e.set_item("kernel", &x.kernel)?;
        e.set_item("groups", x.groups.to_vec())?;
        e.set_item("gpu_us", x.gpu_ns.map(|ns| ns / 1e3))?;
        dispatches.push(e);
    }
    d.set_item("dispatches", PyList::new(py, dispatches)?)?;
    let op_dicts = |ops: Vec<OpProfile>| -> PyResult<Bound<'py, PyList>> {
        let mut v = Vec::new();
        for o in ops {
            let e = PyDict::new(py);
            e.set_item("op", o.op)?;
            e.set_item("layer", o.layer)?;
            e.set_item("kernels", o.kernels.clone())?;
            e.set_item("dispatches", o.dispatches)?;
            e.set_item("gpu_us", o.gpu_us)?;
            e.set_item("bytes", o.bytes)?;
            e.set_item("gb_s", o.gb_per_s())?;
            v.push(e);
        }
        PyList::new(py, v)
    };
    d.set_item("ops", op_dicts(prof.ops())?)?;
    d.set_item("families", op_dicts(prof.families())?)?;
    let st = PyDict::new(py);
    st.set_item("rows", prof.rows)?;
    st.set_item("timestamps", prof.submit.timestamps)?;
    st.set_item("dispatches", prof.counters.dispatches)?;
    st.set_item("submits", prof.counters.submits)?;
    st.set_item("readbacks", prof.counters.readbacks)?;
    st.set_item("created_pipelines", prof.counters.pipelines)?;
    st.set_item("created_bind_groups", prof.counters.bind_groups)?;
    st.set_item("created_buffers", prof.counters.buffers)?;
    st.set_item("gpu_busy_us", prof.gpu_busy_us())?;
    st.set_item("gpu_span_us", prof.submit.gpu_span_ns.map(|ns| ns / 1e3))?;
    st.set_item("profiled", timing_dict(py, &prof.timing)?)?;
    st.set_item("normal", prof.normal.map(|t| timing_dict(py, &t)).transpose()?)?;
    d.set_item("step", st)?;
    Ok(())
}

fn timing_dict<'py>(py: Python<'py>, t: &StepTiming) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("rows", t.rows)?;
    d.set_item("record_us", t.record_us)?;
    d.set_item("submit_us", t.submit_us)?;
    d.set_item("wait_us", t.wait_us)?;
    d.set_item("total_us", t.total_us)?;
    d.set_item("ahead", t.ahead)?;
    Ok(d)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEngine>()
}
