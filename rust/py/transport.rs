//! Python bindings of the qkp codec (the pure part of `transport`): `qkp_encode(dict) -> bytes`,
//! `qkp_decode(bytes) -> dict`, `qkp_decode_header(bytes) -> dict` and the protocol's constants.
//! Codec failures raise `qk.TransportError`. Messages are plain dicts keyed by field name with an
//! `"op"` naming the message (`frame::Op::name`); the keys per op are listed on `qkp_encode`.
//! Also the split-serving classes: `HeadLink` (the head's link to the chain) and `Worker` (a stage's
//! serve loop around a stage, `stage.rs`), both releasing the GIL while they wait on sockets.

use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::conversion::FromPyObjectOwned;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};

use super::errors::{detach, guard};
use crate::error::{QkError, Result};
use crate::transport::conn::Timeouts;
use crate::transport::frame::{self, ErrorCode, Limits, Op};
use crate::transport::head::{HeadConfig, HeadLink};
use crate::transport::hello::{Challenge, ClientHello, HelloReply, Proof, StageDesc};
use crate::transport::messages::{
    Ack, ErrorMsg, HiddenRows, Message, Rows, Run, RunOut, RunReply, Step, StepEntry, StepOut, StepReply,
};
use crate::transport::stage::{Stage, StageInfo};
use crate::transport::worker::{WorkerConfig, WorkerControl, serve_worker};

fn transport(msg: String) -> PyErr {
    QkError::Transport(msg).into()
}

/// The fields of one message dict: every key must be known to the op and every required key present.
pub(super) struct Fields<'py> {
    dict: Bound<'py, PyDict>,
    op: &'static str,
}

impl<'py> Fields<'py> {
    pub(super) fn new(
        dict: &Bound<'py, PyDict>,
        op: &'static str,
        allowed: &[&str],
    ) -> PyResult<Fields<'py>> {
        for key in dict.keys().iter() {
            let key: String = key.extract()?;
            if key != "op" && !allowed.contains(&key.as_str()) {
                return Err(transport(format!("cannot encode {op}: unknown key {key:?}")));
            }
        }
        Ok(Fields {
            dict: dict.clone(),
            op,
        })
    }

    fn has(&self, key: &str) -> PyResult<bool> {
        Ok(self.dict.get_item(key)?.is_some_and(|v| !v.is_none()))
    }

    fn get<T: FromPyObjectOwned<'py>>(&self, key: &str) -> PyResult<T> {
        let value = self
            .dict
            .get_item(key)?
            .ok_or_else(|| transport(format!("cannot encode {}: missing key {key:?}", self.op)))?;
        value.extract::<T>().map_err(Into::into)
    }

    fn array32(&self, key: &str) -> PyResult<[u8; 32]> {
        let bytes: Vec<u8> = self.get(key)?;
        <[u8; 32]>::try_from(bytes.as_slice()).map_err(|_| {
            transport(format!(
                "cannot encode {}: {key} is {} bytes, expected 32",
                self.op,
                bytes.len()
            ))
        })
    }

    fn optional32(&self, key: &str) -> PyResult<Option<[u8; 32]>> {
        if self.has(key)? {
            Ok(Some(self.array32(key)?))
        } else {
            Ok(None)
        }
    }

    /// Rows of a RUN/STEP: `tokens`, or `width` + `hidden` (row-major floats).
    fn rows(&self) -> PyResult<Rows> {
        if self.has("tokens")? {
            return Ok(Rows::Tokens(self.get("tokens")?));
        }
        Ok(Rows::Hidden(self.hidden()?))
    }

    fn hidden(&self) -> PyResult<HiddenRows> {
        Ok(HiddenRows {
            width: self.get("width")?,
            data: self.get("hidden")?,
        })
    }

    fn entries(&self) -> PyResult<Vec<StepEntry>> {
        let pairs: Vec<(u32, u32)> = self.get("entries")?;
        Ok(pairs
            .into_iter()
            .map(|(slot, base)| StepEntry { slot, base })
            .collect())
    }
}

/// The keys of a stage's fixed facts (`StageInfo`), as `describe()` returns them; a hello's stage
/// description adds "name" and "boot_id".
pub(super) const STAGE_INFO_KEYS: [&str; 10] = [
    "layer_first",
    "layer_end",
    "n_layer",
    "n_embd",
    "slots",
    "ctx",
    "snap_entries",
    "snap_bytes",
    "fingerprint",
    "adapter",
];

pub(super) fn stage_info_from(f: &Fields<'_>) -> PyResult<StageInfo> {
    Ok(StageInfo {
        layer_first: f.get("layer_first")?,
        layer_end: f.get("layer_end")?,
        n_layer: f.get("n_layer")?,
        n_embd: f.get("n_embd")?,
        slots: f.get("slots")?,
        ctx: f.get("ctx")?,
        snap_entries: f.get("snap_entries")?,
        snap_bytes: f.get("snap_bytes")?,
        fingerprint: f.get("fingerprint")?,
        adapter: f.get("adapter")?,
    })
}

fn stage_from(dict: &Bound<'_, PyDict>) -> PyResult<StageDesc> {
    let keys: Vec<&str> = ["name", "boot_id"].into_iter().chain(STAGE_INFO_KEYS).collect();
    let f = Fields::new(dict, "hello_reply", &keys)?;
    let (name, boot_id): (String, u64) = (f.get("name")?, f.get("boot_id")?);
    Ok(stage_info_from(&f)?.describe_as(&name, boot_id))
}

fn message_from(dict: &Bound<'_, PyDict>) -> PyResult<Message> {
    let op_name: String = dict
        .get_item("op")?
        .ok_or_else(|| transport("cannot encode: the dict has no \"op\"".into()))?
        .extract()?;
    let op =
        Op::from_name(&op_name).ok_or_else(|| transport(format!("cannot encode: unknown op {op_name:?}")))?;
    let name = op.name();
    Ok(match op {
        Op::Hello => {
            let f = Fields::new(dict, name, &["nonce", "name", "takeover", "has_secret"])?;
            Message::Hello(ClientHello {
                nonce: f.array32("nonce")?,
                name: f.get("name")?,
                takeover: f.get("takeover")?,
                has_secret: f.get("has_secret")?,
            })
        }
        Op::Challenge => {
            let f = Fields::new(dict, name, &["nonce", "has_secret"])?;
            Message::Challenge(Challenge {
                nonce: f.array32("nonce")?,
                has_secret: f.get("has_secret")?,
            })
        }
        Op::Proof => {
            let f = Fields::new(dict, name, &["proof"])?;
            Message::Proof(Proof {
                proof: f.optional32("proof")?,
            })
        }
        Op::HelloReply => {
            let f = Fields::new(dict, name, &["chain", "proof"])?;
            let stages: Vec<Bound<'_, PyDict>> = f.get("chain")?;
            let chain = stages.iter().map(stage_from).collect::<PyResult<Vec<_>>>()?;
            Message::HelloReply(HelloReply {
                chain,
                proof: f.optional32("proof")?,
            })
        }
        Op::Run => {
            let f = Fields::new(dict, name, &["slot", "base", "topk", "tokens", "width", "hidden"])?;
            Message::Run(Run {
                slot: f.get("slot")?,
                base: f.get("base")?,
                topk: f.get("topk")?,
                rows: f.rows()?,
            })
        }
        Op::RunReply => {
            let f = Fields::new(dict, name, &["slot", "base", "ids", "topk", "width", "hidden"])?;
            let out = if f.has("ids")? {
                RunOut::Ids {
                    ids: f.get("ids")?,
                    topk: f.get("topk")?,
                }
            } else {
                RunOut::Hidden(f.hidden()?)
            };
            Message::RunReply(RunReply {
                slot: f.get("slot")?,
                base: f.get("base")?,
                out,
            })
        }
        Op::Step => {
            let f = Fields::new(dict, name, &["topk", "entries", "tokens", "width", "hidden"])?;
            Message::Step(Step {
                topk: f.get("topk")?,
                entries: f.entries()?,
                rows: f.rows()?,
            })
        }
        Op::StepReply => {
            let f = Fields::new(dict, name, &["entries", "ids", "topk", "width", "hidden"])?;
            let out = if f.has("ids")? {
                StepOut::Ids {
                    ids: f.get("ids")?,
                    topk: f.get("topk")?,
                }
            } else {
                StepOut::Hidden(f.hidden()?)
            };
            Message::StepReply(StepReply {
                entries: f.entries()?,
                out,
            })
        }
        Op::Save | Op::Load => {
            let f = Fields::new(dict, name, &["slot", "idx"])?;
            let (slot, idx) = (f.get("slot")?, f.get("idx")?);
            if op == Op::Save {
                Message::Save { slot, idx }
            } else {
                Message::Load { slot, idx }
            }
        }
        Op::Drop => Message::Drop {
            idx: Fields::new(dict, name, &["idx"])?.get("idx")?,
        },
        Op::Ack => {
            let f = Fields::new(dict, name, &["of", "slot", "idx"])?;
            let of_name: String = f.get("of")?;
            let of = Op::from_name(&of_name)
                .ok_or_else(|| transport(format!("cannot encode ack: unknown op {of_name:?}")))?;
            Message::Ack(Ack {
                of,
                slot: f.get("slot")?,
                idx: f.get("idx")?,
            })
        }
        Op::Error => {
            let f = Fields::new(dict, name, &["code", "stage", "message"])?;
            let code_name: String = f.get("code")?;
            let code = ErrorCode::from_name(&code_name)
                .ok_or_else(|| transport(format!("cannot encode error: unknown code {code_name:?}")))?;
            Message::Error(ErrorMsg {
                code,
                stage: f.get("stage")?,
                message: f.get("message")?,
            })
        }
        Op::Close => {
            Fields::new(dict, name, &[])?;
            Message::Close
        }
        Op::Ping | Op::Pong => {
            let seq = Fields::new(dict, name, &["seq"])?.get("seq")?;
            if op == Op::Ping {
                Message::Ping { seq }
            } else {
                Message::Pong { seq }
            }
        }
    })
}

fn put_hidden(d: &Bound<'_, PyDict>, h: &HiddenRows) -> PyResult<()> {
    d.set_item("width", h.width)?;
    d.set_item("hidden", &h.data)
}

fn put_entries(d: &Bound<'_, PyDict>, entries: &[StepEntry]) -> PyResult<()> {
    d.set_item(
        "entries",
        entries.iter().map(|e| (e.slot, e.base)).collect::<Vec<_>>(),
    )
}

pub(super) fn stage_dict<'py>(py: Python<'py>, s: &StageDesc) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("name", &s.name)?;
    d.set_item("boot_id", s.boot_id)?;
    d.set_item("layer_first", s.layer_first)?;
    d.set_item("layer_end", s.layer_end)?;
    d.set_item("n_layer", s.n_layer)?;
    d.set_item("n_embd", s.n_embd)?;
    d.set_item("slots", s.slots)?;
    d.set_item("ctx", s.ctx)?;
    d.set_item("snap_entries", s.snap_entries)?;
    d.set_item("snap_bytes", s.snap_bytes)?;
    d.set_item("fingerprint", &s.fingerprint)?;
    d.set_item("adapter", &s.adapter)?;
    Ok(d)
}

fn bytes_or_none<'py>(py: Python<'py>, b: &Option<[u8; 32]>) -> Option<Bound<'py, PyBytes>> {
    b.as_ref().map(|b| PyBytes::new(py, b))
}

fn message_dict<'py>(py: Python<'py>, msg: &Message) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("op", msg.op().name())?;
    match msg {
        Message::Hello(h) => {
            d.set_item("nonce", PyBytes::new(py, &h.nonce))?;
            d.set_item("name", &h.name)?;
            d.set_item("takeover", h.takeover)?;
            d.set_item("has_secret", h.has_secret)?;
        }
        Message::Challenge(c) => {
            d.set_item("nonce", PyBytes::new(py, &c.nonce))?;
            d.set_item("has_secret", c.has_secret)?;
        }
        Message::Proof(p) => d.set_item("proof", bytes_or_none(py, &p.proof))?,
        Message::HelloReply(r) => {
            let chain = PyList::empty(py);
            for s in &r.chain {
                chain.append(stage_dict(py, s)?)?;
            }
            d.set_item("chain", chain)?;
            d.set_item("proof", bytes_or_none(py, &r.proof))?;
        }
        Message::Run(run) => {
            d.set_item("slot", run.slot)?;
            d.set_item("base", run.base)?;
            d.set_item("topk", run.topk)?;
            match &run.rows {
                Rows::Tokens(ids) => d.set_item("tokens", ids)?,
                Rows::Hidden(h) => put_hidden(&d, h)?,
            }
        }
        Message::RunReply(reply) => {
            d.set_item("slot", reply.slot)?;
            d.set_item("base", reply.base)?;
            match &reply.out {
                RunOut::Ids { ids, topk } => {
                    d.set_item("ids", ids)?;
                    d.set_item("topk", topk)?;
                }
                RunOut::Hidden(h) => put_hidden(&d, h)?,
            }
        }
        Message::Step(step) => {
            d.set_item("topk", step.topk)?;
            put_entries(&d, &step.entries)?;
            match &step.rows {
                Rows::Tokens(ids) => d.set_item("tokens", ids)?,
                Rows::Hidden(h) => put_hidden(&d, h)?,
            }
        }
        Message::StepReply(reply) => {
            put_entries(&d, &reply.entries)?;
            match &reply.out {
                StepOut::Ids { ids, topk } => {
                    d.set_item("ids", ids)?;
                    d.set_item("topk", topk)?;
                }
                StepOut::Hidden(h) => put_hidden(&d, h)?,
            }
        }
        Message::Save { slot, idx } | Message::Load { slot, idx } => {
            d.set_item("slot", slot)?;
            d.set_item("idx", idx)?;
        }
        Message::Drop { idx } => d.set_item("idx", idx)?,
        Message::Ack(ack) => {
            d.set_item("of", ack.of.name())?;
            d.set_item("slot", ack.slot)?;
            d.set_item("idx", ack.idx)?;
        }
        Message::Error(e) => {
            d.set_item("code", e.code.name())?;
            d.set_item("stage", &e.stage)?;
            d.set_item("message", &e.message)?;
        }
        Message::Close => {}
        Message::Ping { seq } | Message::Pong { seq } => d.set_item("seq", seq)?,
    }
    Ok(d)
}

/// Encode a message dict as one qkp frame (header + payload).
///
/// Keys by ``op``: hello {nonce: 32 bytes, name, takeover, has_secret}; challenge {nonce, has_secret};
/// proof {proof: 32 bytes | None}; hello_reply {chain: [stage], proof}; run {slot, base, topk, tokens |
/// width + hidden}; run_reply {slot, base, ids + topk: [(id, logit)] | width + hidden}; step {topk,
/// entries: [(slot, base)], tokens | width + hidden}; step_reply {entries, ids + topk: [[(id, logit)]]
/// | width + hidden}; save/load {slot, idx}; drop {idx}; ack {of, slot, idx}; error {code, stage,
/// message}; close {}; ping/pong {seq}. A stage is {name, boot_id, layer_first, layer_end, n_layer,
/// n_embd, slots, ctx, snap_entries, snap_bytes, fingerprint, adapter}.
///
/// >>> qkp_decode(qkp_encode({"op": "ping", "seq": 7}))
/// {'op': 'ping', 'seq': 7}
#[pyfunction]
fn qkp_encode<'py>(py: Python<'py>, message: &Bound<'py, PyDict>) -> PyResult<Bound<'py, PyBytes>> {
    guard(|| {
        let msg = message_from(message)?;
        let bytes = crate::transport::messages::encode(&msg)?;
        Ok(PyBytes::new(py, &bytes))
    })
}

/// Decode exactly one whole qkp frame into a message dict (the inverse of ``qkp_encode``).
/// Anything malformed raises ``qk.TransportError``.
#[pyfunction]
fn qkp_decode<'py>(py: Python<'py>, frame: &[u8]) -> PyResult<Bound<'py, PyDict>> {
    guard(|| message_dict(py, &crate::transport::messages::decode(frame)?))
}

/// Decode and check a frame header (the first ``QKP_HEADER_LEN`` bytes) into its fields.
#[pyfunction]
fn qkp_decode_header<'py>(py: Python<'py>, header: &[u8]) -> PyResult<Bound<'py, PyDict>> {
    let h = guard(|| Ok(frame::decode_header(header, &Limits::default())?))?;
    let d = PyDict::new(py);
    d.set_item("op", h.op.name())?;
    d.set_item("flags", h.flags)?;
    d.set_item("slot", h.slot)?;
    d.set_item("n", h.n)?;
    d.set_item("base", h.base)?;
    d.set_item("arg", h.arg)?;
    d.set_item("width", h.width)?;
    d.set_item("len", h.len)?;
    Ok(d)
}

/// (id, logit) pairs of one position, best first.
pub(super) type TopK = Vec<(u32, f32)>;

/// A shared secret given as str (UTF-8) or bytes.
fn secret_bytes(secret: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Vec<u8>>> {
    let Some(secret) = secret.filter(|s| !s.is_none()) else {
        return Ok(None);
    };
    if let Ok(text) = secret.cast::<PyString>() {
        return Ok(Some(text.to_str()?.as_bytes().to_vec()));
    }
    Ok(Some(secret.extract::<Vec<u8>>()?))
}

pub(super) fn seconds(what: &str, s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s)
        .map_err(|_| PyValueError::new_err(format!("{what}: {s} is not a duration in seconds")))
}

/// The `*_timeout` keyword arguments, in seconds: connect, hello, pre_auth, base, per_row; and
/// `spin_wait_us`, how long a wait for the peer polls the socket before it sleeps.
fn timeouts_from(t: [f64; 5], spin_wait_us: u64) -> PyResult<Timeouts> {
    Ok(Timeouts {
        spin: Duration::from_micros(spin_wait_us),
        connect: seconds("connect_timeout", t[0])?,
        hello: seconds("hello_timeout", t[1])?,
        pre_auth: seconds("pre_auth_timeout", t[2])?,
        base: seconds("base_timeout", t[3])?,
        per_row: seconds("per_row_timeout", t[4])?,
    })
}

/// The rows of a RUN or STEP: `tokens` (ids), or `hidden` (a 2-D float32 array, one row per position).
fn rows_arg(tokens: Option<Vec<u32>>, hidden: Option<PyReadonlyArray2<'_, f32>>) -> PyResult<Rows> {
    match (tokens, hidden) {
        (Some(ids), None) => Ok(Rows::Tokens(ids)),
        (None, Some(h)) => {
            let width = u32::try_from(h.shape()[1])
                .map_err(|_| PyValueError::new_err(format!("hidden rows of width {}", h.shape()[1])))?;
            Ok(Rows::Hidden(HiddenRows {
                width,
                data: h.as_array().iter().copied().collect(),
            }))
        }
        _ => Err(PyValueError::new_err("give exactly one of tokens= and hidden=")),
    }
}

pub(super) fn hidden_array<'py>(py: Python<'py>, h: &HiddenRows) -> PyResult<Bound<'py, PyAny>> {
    let rows = h.data.len() / h.width.max(1) as usize;
    Ok(PyArray1::from_vec(py, h.data.clone())
        .reshape([rows, h.width as usize])?
        .into_any())
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic in a call leaves the link or worker state as plain data; later calls report on it.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The head's link to the chain of stages after it (docs/protocol.md). ``takeover=True`` replaces a
/// session another head holds on the chain (opt-in); a head whose session is taken over is told who
/// took it and when (``taken_over``), fails calls with that, and reconnects only in the background
/// once the chain is free (without taking it back). Connects lazily: the first call
/// (or ``connect()``) says hello and checks the chain against ``own``; a failed call marks the link
/// down and the next call reconnects at once; ``reconnect_if_due()`` retries with backoff for a
/// background ticker. Every reconnect is a new session: every stage reset its slots and dropped its
/// snapshots, and ``take_restarted()`` names the stages whose boot id changed. Failures raise
/// ``qk.TransportError`` with the failing stage's name. Calls release the GIL while they wait.
///
/// ``own`` is the head's stage description (the dict keys of a hello_reply stage). One call runs at
/// a time; the others (getters included) wait for it without holding the GIL. ``spin_wait_us``: how
/// long a wait for the chain's reply polls the socket before it sleeps (0: at once; a head on a GPU
/// passes its engine's ``spin_wait_us``).
#[pyclass(name = "HeadLink", module = "qk._qk", frozen)]
pub(super) struct PyHeadLink {
    /// Shared with the `SplitHead` built on this link, whose link thread makes the calls.
    link: Arc<Mutex<HeadLink>>,
}

impl PyHeadLink {
    pub(super) fn shared(&self) -> Arc<Mutex<HeadLink>> {
        Arc::clone(&self.link)
    }

    /// Run `f` on the link with the GIL released; a panic is answered as qk.InternalError.
    fn call<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut HeadLink) -> Result<T> + Send,
    ) -> PyResult<T> {
        detach(py, || f(&mut lock(&self.link)))
    }
}

#[pymethods]
impl PyHeadLink {
    #[new]
    #[pyo3(signature = (next, own, *, secret=None, takeover=false, connect_timeout=5.0, hello_timeout=30.0,
        base_timeout=30.0, per_row_timeout=0.02, backoff_min=0.25, backoff_max=10.0, spin_wait_us=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        next: &str,
        own: &Bound<'_, PyDict>,
        secret: Option<&Bound<'_, PyAny>>,
        takeover: bool,
        connect_timeout: f64,
        hello_timeout: f64,
        base_timeout: f64,
        per_row_timeout: f64,
        backoff_min: f64,
        backoff_max: f64,
        spin_wait_us: u64,
    ) -> PyResult<PyHeadLink> {
        let mut cfg = HeadConfig::new(next, stage_from(own)?);
        cfg.secret = secret_bytes(secret)?;
        cfg.takeover = takeover;
        // A head accepts no connections: the pre-auth bound is a worker's.
        let pre_auth = cfg.timeouts.pre_auth.as_secs_f64();
        cfg.timeouts = timeouts_from(
            [
                connect_timeout,
                hello_timeout,
                pre_auth,
                base_timeout,
                per_row_timeout,
            ],
            spin_wait_us,
        )?;
        cfg.backoff_min = seconds("backoff_min", backoff_min)?;
        cfg.backoff_max = seconds("backoff_max", backoff_max)?;
        Ok(PyHeadLink {
            link: Arc::new(Mutex::new(HeadLink::new(cfg))),
        })
    }

    /// Connect and hello now (ending a live session first); returns the chain after the head.
    fn connect<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let chain = self.call(py, |link| link.connect().map(<[StageDesc]>::to_vec))?;
        chain.iter().map(|s| stage_dict(py, s)).collect()
    }

    /// Positions [base, base + n) of ``slot``: ``tokens`` or ``hidden`` (n × n_embd float32). Returns
    /// (greedy ids, [(id, logit)] top-k of the final position).
    #[pyo3(signature = (slot, base, *, tokens=None, hidden=None, topk=0))]
    fn run(
        &self,
        py: Python<'_>,
        slot: u32,
        base: u32,
        tokens: Option<Vec<u32>>,
        hidden: Option<PyReadonlyArray2<'_, f32>>,
        topk: u32,
    ) -> PyResult<(Vec<u32>, TopK)> {
        let rows = rows_arg(tokens, hidden)?;
        let result = self.call(py, |link| link.run(slot, base, rows, topk))?;
        Ok((result.ids, result.topk))
    }

    /// One decode position for each (slot, base) entry, one row per entry. Returns (ids, top-k lists).
    #[pyo3(signature = (entries, *, tokens=None, hidden=None, topk=0))]
    fn step(
        &self,
        py: Python<'_>,
        entries: Vec<(u32, u32)>,
        tokens: Option<Vec<u32>>,
        hidden: Option<PyReadonlyArray2<'_, f32>>,
        topk: u32,
    ) -> PyResult<(Vec<u32>, Vec<TopK>)> {
        let rows = rows_arg(tokens, hidden)?;
        let entries = entries
            .into_iter()
            .map(|(slot, base)| StepEntry { slot, base })
            .collect();
        let result = self.call(py, |link| link.step(entries, rows, topk))?;
        Ok((result.ids, result.topk))
    }

    /// Snapshot ``slot`` into entry ``idx`` on every stage of the chain.
    fn save(&self, py: Python<'_>, slot: u32, idx: u32) -> PyResult<()> {
        self.call(py, |link| link.save(slot, idx))
    }

    fn load(&self, py: Python<'_>, slot: u32, idx: u32) -> PyResult<()> {
        self.call(py, |link| link.load(slot, idx))
    }

    fn drop(&self, py: Python<'_>, idx: u32) -> PyResult<()> {
        self.call(py, |link| link.drop_snapshot(idx))
    }

    /// Round-trip time through the whole chain, in seconds.
    fn ping(&self, py: Python<'_>) -> PyResult<f64> {
        Ok(self.call(py, HeadLink::ping)?.as_secs_f64())
    }

    /// End the session cleanly; the next call reconnects.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.call(py, |link| {
            link.close();
            Ok(())
        })
    }

    /// Between calls: take in what the chain sent unasked (a takeover notice, or its close) and
    /// mark the link down with it. True while the link is up; waits at most a millisecond.
    fn poll(&self, py: Python<'_>) -> PyResult<bool> {
        self.call(py, |link| Ok(link.poll()))
    }

    /// If the link is down and its backoff has passed, try to reconnect: True when it did, False when
    /// nothing was due; a failed attempt raises.
    fn reconnect_if_due(&self, py: Python<'_>) -> PyResult<bool> {
        self.call(py, |link| {
            link.reconnect_if_due().transpose().map(|r| r.is_some())
        })
    }

    /// Names of the stages that restarted (changed boot id) at a reconnect since the last call.
    fn take_restarted(&self, py: Python<'_>) -> Vec<String> {
        py.detach(|| lock(&self.link).take_restarted())
    }

    #[getter]
    fn is_up(&self, py: Python<'_>) -> bool {
        py.detach(|| lock(&self.link).is_up())
    }

    /// The chain after the head as of the latest session.
    #[getter]
    fn chain<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let chain = py.detach(|| lock(&self.link).chain().to_vec());
        chain.iter().map(|s| stage_dict(py, s)).collect()
    }

    /// Sessions established so far.
    #[getter]
    fn sessions(&self, py: Python<'_>) -> u64 {
        py.detach(|| lock(&self.link).sessions())
    }

    /// Snapshot entries usable on every stage, the head included.
    #[getter]
    fn snapshot_entries(&self, py: Python<'_>) -> u32 {
        py.detach(|| lock(&self.link).snapshot_entries())
    }

    #[getter]
    fn last_error(&self, py: Python<'_>) -> Option<String> {
        py.detach(|| lock(&self.link).last_error().map(str::to_string))
    }

    /// "taken over by head 'X' at T" while another head holds the chain this head lost to it.
    #[getter]
    fn taken_over(&self, py: Python<'_>) -> Option<String> {
        py.detach(|| lock(&self.link).taken_over().map(str::to_string))
    }

    /// Seconds until a background retry is due, while the link is down.
    #[getter]
    fn retry_in(&self, py: Python<'_>) -> Option<f64> {
        py.detach(|| lock(&self.link).retry_in().map(|d| d.as_secs_f64()))
    }
}

// The signature's default must be a literal for Python to show it: keep it the core's default.
const _: () = assert!(crate::transport::worker::MAX_PENDING == 16);

/// A stage's qkp server (``python -m qk.worker`` runs one around an ``EngineStage``): binds ``host:port`` at once (``port=0``
/// picks a free port, see ``.port``), and ``serve()`` blocks, with the GIL released, answering one head
/// session at a time until ``stop()`` is called from another thread. ``next`` is host:port of the
/// next stage (None for the last stage); ``secret`` (str or bytes) is proved on both of its hops.
/// Before a peer has proved the secret, only hello-sized frames are read from it, it has
/// ``pre_auth_timeout`` seconds for its hello and proof, and at most ``max_pending`` connections may
/// be in their hello at once (more are refused at accept). ``spin_wait_us``: how long a wait for the
/// next request (or the next stage's reply) polls the socket before it sleeps (0: at once).
#[pyclass(name = "Worker", module = "qk._qk", frozen)]
struct PyWorker {
    listener: Mutex<Option<TcpListener>>,
    stage: Mutex<Option<Box<dyn Stage + Send>>>,
    address: SocketAddr,
    cfg: WorkerConfig,
    control: WorkerControl,
}

#[pymethods]
impl PyWorker {
    #[new]
    #[pyo3(signature = (stage, *, host="127.0.0.1", port=0, name=None, secret=None, next=None,
        takeover_next=true, connect_timeout=5.0, hello_timeout=30.0, pre_auth_timeout=5.0, base_timeout=30.0,
        per_row_timeout=0.02, max_pending=16, spin_wait_us=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        stage: &Bound<'_, PyAny>,
        host: &str,
        port: u16,
        name: Option<String>,
        secret: Option<&Bound<'_, PyAny>>,
        next: Option<String>,
        takeover_next: bool,
        connect_timeout: f64,
        hello_timeout: f64,
        pre_auth_timeout: f64,
        base_timeout: f64,
        per_row_timeout: f64,
        max_pending: usize,
        spin_wait_us: u64,
    ) -> PyResult<PyWorker> {
        let stage = super::stage::stage_of(stage)?;
        let listener = TcpListener::bind((host, port))
            .map_err(|e| QkError::Transport(format!("cannot listen on {host}:{port}: {e}")))?;
        let address = listener
            .local_addr()
            .map_err(|e| QkError::Transport(format!("listening socket: {e}")))?;
        let mut cfg = WorkerConfig::new(&name.unwrap_or_else(|| address.to_string()));
        cfg.secret = secret_bytes(secret)?;
        if cfg.secret.as_ref().is_some_and(Vec::is_empty) {
            return Err(PyValueError::new_err("the shared secret is empty"));
        }
        cfg.next = next;
        cfg.takeover_next = takeover_next;
        cfg.timeouts = timeouts_from(
            [
                connect_timeout,
                hello_timeout,
                pre_auth_timeout,
                base_timeout,
                per_row_timeout,
            ],
            spin_wait_us,
        )?;
        if max_pending == 0 {
            return Err(PyValueError::new_err("max_pending must be at least 1"));
        }
        cfg.max_pending = max_pending;
        Ok(PyWorker {
            listener: Mutex::new(Some(listener)),
            stage: Mutex::new(Some(stage)),
            address,
            cfg,
            control: WorkerControl::new(),
        })
    }

    /// Serve until ``stop()``; the listening socket is closed when this returns. Once only.
    fn serve(&self, py: Python<'_>) -> PyResult<()> {
        let listener = lock(&self.listener).take();
        let stage = lock(&self.stage).take();
        let (Some(listener), Some(mut stage)) = (listener, stage) else {
            return Err(QkError::Transport(format!("worker '{}' has already served", self.cfg.name)).into());
        };
        detach(py, || {
            serve_worker(&listener, stage.as_mut(), &self.cfg, &self.control)
        })
    }

    /// Stop serving: no new connections, every open one shut; ``serve()`` returns.
    fn stop(&self) {
        self.control.stop();
    }

    #[getter]
    fn port(&self) -> u16 {
        self.address.port()
    }

    #[getter]
    fn host(&self) -> String {
        self.address.ip().to_string()
    }

    #[getter]
    fn name(&self) -> &str {
        &self.cfg.name
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(qkp_encode, m)?)?;
    m.add_function(wrap_pyfunction!(qkp_decode, m)?)?;
    m.add_function(wrap_pyfunction!(qkp_decode_header, m)?)?;
    m.add_class::<PyHeadLink>()?;
    m.add_class::<PyWorker>()?;
    m.add("QKP_VERSION", frame::VERSION)?;
    m.add("QKP_HEADER_LEN", frame::HEADER_LEN)?;
    m.add("QKP_MAX_ROWS", frame::MAX_ROWS)?;
    m.add("QKP_MAX_WIDTH", frame::MAX_WIDTH)?;
    m.add("QKP_MAX_TOPK", frame::MAX_TOPK)?;
    m.add("QKP_MAX_STAGES", frame::MAX_STAGES)?;
    m.add("QKP_MAX_NAME", frame::MAX_NAME)?;
    m.add("QKP_MAX_MESSAGE", frame::MAX_MESSAGE)?;
    Ok(())
}
