//! Python bindings of the qkp codec (the pure part of `transport`): `qkp_encode(dict) -> bytes`,
//! `qkp_decode(bytes) -> dict`, `qkp_decode_header(bytes) -> dict` and the protocol's constants.
//! Codec failures raise `qk.TransportError`. Messages are plain dicts keyed by field name with an
//! `"op"` naming the message (`frame::Op::name`); the keys per op are listed on `qkp_encode`.

use pyo3::conversion::FromPyObjectOwned;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::error::QkError;
use crate::transport::frame::{self, ErrorCode, Limits, Op};
use crate::transport::hello::{Challenge, ClientHello, HelloReply, Proof, StageDesc};
use crate::transport::messages::{
    Ack, ErrorMsg, HiddenRows, Message, Rows, Run, RunOut, RunReply, Step, StepEntry, StepOut, StepReply,
};

fn transport(msg: String) -> PyErr {
    QkError::Transport(msg).into()
}

/// The fields of one message dict: every key must be known to the op and every required key present.
struct Fields<'py> {
    dict: Bound<'py, PyDict>,
    op: &'static str,
}

impl<'py> Fields<'py> {
    fn new(dict: &Bound<'py, PyDict>, op: &'static str, allowed: &[&str]) -> PyResult<Fields<'py>> {
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

fn stage_from(dict: &Bound<'_, PyDict>) -> PyResult<StageDesc> {
    let f = Fields::new(
        dict,
        "hello_reply",
        &[
            "name",
            "boot_id",
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
        ],
    )?;
    Ok(StageDesc {
        name: f.get("name")?,
        boot_id: f.get("boot_id")?,
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

fn stage_dict<'py>(py: Python<'py>, s: &StageDesc) -> PyResult<Bound<'py, PyDict>> {
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
    let msg = message_from(message)?;
    let bytes = crate::transport::messages::encode(&msg)?;
    Ok(PyBytes::new(py, &bytes))
}

/// Decode exactly one whole qkp frame into a message dict (the inverse of ``qkp_encode``).
/// Anything malformed raises ``qk.TransportError``.
#[pyfunction]
fn qkp_decode<'py>(py: Python<'py>, frame: &[u8]) -> PyResult<Bound<'py, PyDict>> {
    let msg = crate::transport::messages::decode(frame)?;
    message_dict(py, &msg)
}

/// Decode and check a frame header (the first ``QKP_HEADER_LEN`` bytes) into its fields.
#[pyfunction]
fn qkp_decode_header<'py>(py: Python<'py>, header: &[u8]) -> PyResult<Bound<'py, PyDict>> {
    let h = frame::decode_header(header, &Limits::default())?;
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

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(qkp_encode, m)?)?;
    m.add_function(wrap_pyfunction!(qkp_decode, m)?)?;
    m.add_function(wrap_pyfunction!(qkp_decode_header, m)?)?;
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
