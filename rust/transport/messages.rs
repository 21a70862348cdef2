//! Typed qkp messages and their conversion to and from whole frames (header + payload). Pure: bytes in,
//! bytes out. The byte layout of every payload is documented at the top of `frame.rs`.

use std::fmt;

use crate::error::{QkError, Result};
use crate::transport::frame::{
    self, ErrorCode, FLAG_SECRET, FLAG_TAKEOVER, HEADER_LEN, Header, Limits, MAX_MESSAGE, MAX_NAME,
    MAX_STAGES, Op,
};
use crate::transport::hello::{Challenge, ClientHello, HelloReply, Proof, StageDesc};

/// Hidden rows: `data.len() / width` rows of `width` (n_embd) f32 each, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct HiddenRows {
    pub width: u32,
    pub data: Vec<f32>,
}

/// The rows of a RUN or STEP: token ids (into the stage that embeds) or hidden rows.
#[derive(Clone, Debug, PartialEq)]
pub enum Rows {
    Tokens(Vec<u32>),
    Hidden(HiddenRows),
}

/// RUN: positions [base, base + n) of a slot; base == 0 resets the slot on every stage.
#[derive(Clone, Debug, PartialEq)]
pub struct Run {
    pub slot: u32,
    pub base: u32,
    /// Top-k (id, logit) pairs wanted for the final position; 0 = greedy ids only.
    pub topk: u32,
    pub rows: Rows,
}

/// What a stage answers a RUN with: the last stage's greedy ids (and top-k of the final position),
/// or hidden rows when a stage hands its output back instead of forwarding it.
#[derive(Clone, Debug, PartialEq)]
pub enum RunOut {
    Ids { ids: Vec<u32>, topk: Vec<(u32, f32)> },
    Hidden(HiddenRows),
}

/// RUN_REPLY: echoes the request's slot and base so a reader can match it.
#[derive(Clone, Debug, PartialEq)]
pub struct RunReply {
    pub slot: u32,
    pub base: u32,
    pub out: RunOut,
}

/// One slot's decode position in a STEP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepEntry {
    pub slot: u32,
    pub base: u32,
}

/// STEP: one position for each of several slots; `rows` has one row per entry, in entry order.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub topk: u32,
    pub entries: Vec<StepEntry>,
    pub rows: Rows,
}

/// A STEP's results, one per entry: a greedy id and its top-k, or a hidden row.
#[derive(Clone, Debug, PartialEq)]
pub enum StepOut {
    Ids {
        ids: Vec<u32>,
        topk: Vec<Vec<(u32, f32)>>,
    },
    Hidden(HiddenRows),
}

/// STEP_REPLY: echoes the entries of the request.
#[derive(Clone, Debug, PartialEq)]
pub struct StepReply {
    pub entries: Vec<StepEntry>,
    pub out: StepOut,
}

/// ACK of a SAVE, LOAD or DROP, sent once the whole chain has done it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ack {
    pub of: Op,
    pub slot: u32,
    pub idx: u32,
}

/// ERROR: sent instead of a result. `stage` names the stage that failed, so a relayed error reaches
/// the head with its origin on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ErrorMsg {
    pub code: ErrorCode,
    pub stage: String,
    pub message: String,
}

impl ErrorMsg {
    /// An error with its strings cut (at a character boundary) to what the frame allows, so that
    /// sending an error never fails for being too long.
    pub fn new(code: ErrorCode, stage: &str, message: impl Into<String>) -> ErrorMsg {
        ErrorMsg {
            code,
            stage: truncate(stage, MAX_NAME),
            message: truncate(&message.into(), MAX_MESSAGE),
        }
    }

    /// The error as the core's transport error, with the same text.
    pub fn to_error(&self) -> QkError {
        QkError::Transport(self.to_string())
    }
}

impl fmt::Display for ErrorMsg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: stage '{}': {}",
            self.code.describe(),
            self.stage,
            self.message
        )
    }
}

fn truncate(s: &str, cap: usize) -> String {
    if s.len() <= cap {
        return s.to_string();
    }
    let mut end = cap;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

/// Every message of the protocol, requests and replies alike.
#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    Hello(ClientHello),
    Challenge(Challenge),
    Proof(Proof),
    HelloReply(HelloReply),
    Run(Run),
    RunReply(RunReply),
    Step(Step),
    StepReply(StepReply),
    Save { slot: u32, idx: u32 },
    Load { slot: u32, idx: u32 },
    Drop { idx: u32 },
    Ack(Ack),
    Error(ErrorMsg),
    Close,
    Ping { seq: u32 },
    Pong { seq: u32 },
}

impl Message {
    pub fn op(&self) -> Op {
        match self {
            Message::Hello(_) => Op::Hello,
            Message::Challenge(_) => Op::Challenge,
            Message::Proof(_) => Op::Proof,
            Message::HelloReply(_) => Op::HelloReply,
            Message::Run(_) => Op::Run,
            Message::RunReply(_) => Op::RunReply,
            Message::Step(_) => Op::Step,
            Message::StepReply(_) => Op::StepReply,
            Message::Save { .. } => Op::Save,
            Message::Load { .. } => Op::Load,
            Message::Drop { .. } => Op::Drop,
            Message::Ack(_) => Op::Ack,
            Message::Error(_) => Op::Error,
            Message::Close => Op::Close,
            Message::Ping { .. } => Op::Ping,
            Message::Pong { .. } => Op::Pong,
        }
    }

    /// Rows (or STEP entries) the message carries or asks for: what its timeouts scale with.
    pub fn rows(&self) -> u32 {
        let n = match self {
            Message::Run(run) => rows_len(&run.rows),
            Message::RunReply(reply) => match &reply.out {
                RunOut::Ids { ids, .. } => ids.len(),
                RunOut::Hidden(h) => hidden_rows(h),
            },
            Message::Step(step) => step.entries.len(),
            Message::StepReply(reply) => reply.entries.len(),
            _ => 0,
        };
        u32::try_from(n).unwrap_or(u32::MAX)
    }
}

fn hidden_rows(h: &HiddenRows) -> usize {
    if h.width == 0 {
        0
    } else {
        h.data.len() / h.width as usize
    }
}

fn rows_len(rows: &Rows) -> usize {
    match rows {
        Rows::Tokens(ids) => ids.len(),
        Rows::Hidden(h) => hidden_rows(h),
    }
}

fn invalid(op: Op, msg: String) -> QkError {
    QkError::Transport(format!("cannot encode {}: {msg}", op.name()))
}

fn count(op: Op, what: &str, n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| invalid(op, format!("{what} count {n} does not fit the frame")))
}

/// Little-endian writers for a payload being built after a header placeholder.
struct Writer {
    out: Vec<u8>,
    op: Op,
}

impl Writer {
    fn u16(&mut self, v: u16) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.out.extend_from_slice(b);
    }
    fn str(&mut self, s: &str, cap: usize, what: &str) -> Result<()> {
        if s.len() > cap {
            return Err(invalid(
                self.op,
                format!("{what} is {} bytes, the cap is {cap}", s.len()),
            ));
        }
        self.u16(s.len() as u16);
        self.bytes(s.as_bytes());
        Ok(())
    }
    fn u32s(&mut self, v: &[u32]) {
        if cfg!(target_endian = "little") {
            self.bytes(bytemuck::cast_slice(v));
        } else {
            v.iter().for_each(|x| self.u32(*x));
        }
    }
    fn f32s(&mut self, v: &[f32]) {
        if cfg!(target_endian = "little") {
            self.bytes(bytemuck::cast_slice(v));
        } else {
            v.iter().for_each(|x| self.u32(x.to_bits()));
        }
    }
    fn pairs(&mut self, pairs: &[(u32, f32)]) {
        for (id, logit) in pairs {
            self.u32(*id);
            self.u32(logit.to_bits());
        }
    }
    fn stage(&mut self, s: &StageDesc) -> Result<()> {
        self.str(&s.name, MAX_NAME, "stage name")?;
        self.u64(s.boot_id);
        for v in [
            s.layer_first,
            s.layer_end,
            s.n_layer,
            s.n_embd,
            s.slots,
            s.ctx,
            s.snap_entries,
        ] {
            self.u32(v);
        }
        self.u64(s.snap_bytes);
        self.str(&s.fingerprint, MAX_NAME, "model fingerprint")?;
        self.str(&s.adapter, MAX_NAME, "adapter name")
    }
}

/// Sets `h.n` and `h.width` for `rows` and writes them; checks a hidden payload is whole rows.
fn put_rows(w: &mut Writer, h: &mut Header, rows: &Rows) -> Result<()> {
    match rows {
        Rows::Tokens(ids) => {
            h.n = count(w.op, "row", ids.len())?;
            w.u32s(ids);
        }
        Rows::Hidden(hidden) => {
            put_hidden_shape(w.op, h, hidden)?;
            w.f32s(&hidden.data);
        }
    }
    Ok(())
}

fn put_hidden_shape(op: Op, h: &mut Header, hidden: &HiddenRows) -> Result<()> {
    if hidden.width == 0 || !hidden.data.len().is_multiple_of(hidden.width as usize) {
        return Err(invalid(
            op,
            format!(
                "{} floats are not whole rows of width {}",
                hidden.data.len(),
                hidden.width
            ),
        ));
    }
    h.width = hidden.width;
    h.n = count(op, "row", hidden.data.len() / hidden.width as usize)?;
    Ok(())
}

fn put_entries(w: &mut Writer, entries: &[StepEntry]) {
    for e in entries {
        w.u32(e.slot);
        w.u32(e.base);
    }
}

/// Encode a message as one frame (header + payload). Everything the decoder would refuse is refused
/// here too, so an encoded frame always decodes back to the same message.
pub fn encode(msg: &Message) -> Result<Vec<u8>> {
    let op = msg.op();
    let mut h = Header::new(op);
    let mut w = Writer {
        out: vec![0u8; HEADER_LEN],
        op,
    };
    match msg {
        Message::Hello(hello) => {
            if hello.takeover {
                h.flags |= FLAG_TAKEOVER;
            }
            if hello.has_secret {
                h.flags |= FLAG_SECRET;
            }
            w.bytes(&hello.nonce);
            w.str(&hello.name, MAX_NAME, "client name")?;
        }
        Message::Challenge(c) => {
            if c.has_secret {
                h.flags |= FLAG_SECRET;
            }
            w.bytes(&c.nonce);
        }
        Message::Proof(p) => {
            if let Some(proof) = &p.proof {
                h.flags |= FLAG_SECRET;
                w.bytes(proof);
            }
        }
        Message::HelloReply(reply) => {
            if reply.chain.is_empty() || reply.chain.len() > MAX_STAGES as usize {
                return Err(invalid(
                    op,
                    format!("{} stages, allowed 1..={MAX_STAGES}", reply.chain.len()),
                ));
            }
            h.n = reply.chain.len() as u32;
            for stage in &reply.chain {
                w.stage(stage)?;
            }
            if let Some(proof) = &reply.proof {
                h.flags |= FLAG_SECRET;
                w.bytes(proof);
            }
        }
        Message::Run(run) => {
            h.slot = run.slot;
            h.base = run.base;
            h.arg = run.topk;
            put_rows(&mut w, &mut h, &run.rows)?;
        }
        Message::RunReply(reply) => {
            h.slot = reply.slot;
            h.base = reply.base;
            match &reply.out {
                RunOut::Ids { ids, topk } => {
                    h.n = count(op, "id", ids.len())?;
                    h.arg = count(op, "top-k", topk.len())?;
                    w.u32s(ids);
                    w.pairs(topk);
                }
                RunOut::Hidden(hidden) => {
                    put_hidden_shape(op, &mut h, hidden)?;
                    w.f32s(&hidden.data);
                }
            }
        }
        Message::Step(step) => {
            h.arg = step.topk;
            h.n = count(op, "entry", step.entries.len())?;
            put_entries(&mut w, &step.entries);
            put_rows(&mut w, &mut h, &step.rows)?;
            if h.n as usize != step.entries.len() {
                return Err(invalid(
                    op,
                    format!("{} entries but {} rows", step.entries.len(), h.n),
                ));
            }
        }
        Message::StepReply(reply) => {
            let n = reply.entries.len();
            h.n = count(op, "entry", n)?;
            put_entries(&mut w, &reply.entries);
            match &reply.out {
                StepOut::Ids { ids, topk } => {
                    if ids.len() != n || topk.len() != n {
                        return Err(invalid(
                            op,
                            format!("{n} entries but {} ids and {} top-k lists", ids.len(), topk.len()),
                        ));
                    }
                    let k = topk.first().map_or(0, Vec::len);
                    if topk.iter().any(|t| t.len() != k) {
                        return Err(invalid(op, "top-k lists of different lengths".into()));
                    }
                    h.arg = count(op, "top-k", k)?;
                    w.u32s(ids);
                    topk.iter().for_each(|t| w.pairs(t));
                }
                StepOut::Hidden(hidden) => {
                    put_hidden_shape(op, &mut h, hidden)?;
                    if h.n as usize != n {
                        return Err(invalid(op, format!("{n} entries but {} hidden rows", h.n)));
                    }
                    w.f32s(&hidden.data);
                }
            }
        }
        Message::Save { slot, idx } | Message::Load { slot, idx } => {
            h.slot = *slot;
            h.arg = *idx;
        }
        Message::Drop { idx } => h.arg = *idx,
        Message::Ack(ack) => {
            if !matches!(ack.of, Op::Save | Op::Load | Op::Drop) {
                return Err(invalid(
                    op,
                    format!("an ack of {} is not a message", ack.of.name()),
                ));
            }
            h.slot = ack.slot;
            h.arg = ack.idx;
            w.u32(ack.of as u32);
        }
        Message::Error(e) => {
            h.arg = e.code as u32;
            w.str(&e.stage, MAX_NAME, "stage name")?;
            w.str(&e.message, MAX_MESSAGE, "error message")?;
        }
        Message::Close => {}
        Message::Ping { seq } | Message::Pong { seq } => h.arg = *seq,
    }
    let payload = w.out.len() - HEADER_LEN;
    h.len = u32::try_from(payload).map_err(|_| invalid(op, format!("payload of {payload} bytes")))?;
    frame::check_header(&h, &Limits::default()).map_err(|e| invalid(op, e.to_string()))?;
    w.out[..HEADER_LEN].copy_from_slice(&frame::encode_header(&h));
    Ok(w.out)
}

/// Decode one whole frame: exactly a header and the payload it announces, nothing after.
pub fn decode(bytes: &[u8]) -> Result<Message> {
    decode_with(bytes, &Limits::default())
}

pub fn decode_with(bytes: &[u8], limits: &Limits) -> Result<Message> {
    let h = frame::decode_header(bytes, limits)?;
    let payload = &bytes[HEADER_LEN..];
    decode_payload(&h, payload)
}

/// Little-endian readers over a payload whose total length the header already checked.
struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
    op: Op,
}

impl<'a> Reader<'a> {
    fn bad(&self, msg: String) -> QkError {
        QkError::Transport(format!("bad frame: {}: {msg}", self.op.name()))
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.buf.len() - self.at < n {
            return Err(self.bad(format!(
                "payload ends at byte {} reading {n} more",
                self.buf.len()
            )));
        }
        let out = &self.buf[self.at..self.at + n];
        self.at += n;
        Ok(out)
    }
    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes([
            b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7],
        ]))
    }
    fn array32(&mut self) -> Result<[u8; 32]> {
        let mut out = [0u8; 32];
        out.copy_from_slice(self.take(32)?);
        Ok(out)
    }
    fn str(&mut self, cap: usize, what: &str) -> Result<String> {
        let b = self.take(2)?;
        let len = u16::from_le_bytes([b[0], b[1]]) as usize;
        if len > cap {
            return Err(self.bad(format!("{what} is {len} bytes, the cap is {cap}")));
        }
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.bad(format!("{what} is not UTF-8")))
    }
    fn u32s(&mut self, n: usize) -> Result<Vec<u32>> {
        let bytes = self.take(n * 4)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
    fn f32s(&mut self, n: usize) -> Result<Vec<f32>> {
        let bytes = self.take(n * 4)?;
        if cfg!(target_endian = "little") {
            // Copies into an f32-aligned vector; the payload buffer has byte alignment only.
            return Ok(bytemuck::pod_collect_to_vec(bytes));
        }
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
    fn pairs(&mut self, k: usize) -> Result<Vec<(u32, f32)>> {
        (0..k)
            .map(|_| Ok((self.u32()?, f32::from_bits(self.u32()?))))
            .collect()
    }
    fn entries(&mut self, n: usize) -> Result<Vec<StepEntry>> {
        (0..n)
            .map(|_| {
                Ok(StepEntry {
                    slot: self.u32()?,
                    base: self.u32()?,
                })
            })
            .collect()
    }
    fn rows(&mut self, n: usize, width: u32) -> Result<Rows> {
        if width == 0 {
            return Ok(Rows::Tokens(self.u32s(n)?));
        }
        Ok(Rows::Hidden(HiddenRows {
            width,
            data: self.f32s(n * width as usize)?,
        }))
    }
    fn stage(&mut self) -> Result<StageDesc> {
        let name = self.str(MAX_NAME, "stage name")?;
        let boot_id = self.u64()?;
        let mut v = [0u32; 7];
        for x in v.iter_mut() {
            *x = self.u32()?;
        }
        let [layer_first, layer_end, n_layer, n_embd, slots, ctx, snap_entries] = v;
        Ok(StageDesc {
            name,
            boot_id,
            layer_first,
            layer_end,
            n_layer,
            n_embd,
            slots,
            ctx,
            snap_entries,
            snap_bytes: self.u64()?,
            fingerprint: self.str(MAX_NAME, "model fingerprint")?,
            adapter: self.str(MAX_NAME, "adapter name")?,
        })
    }
    fn end(&self) -> Result<()> {
        if self.at != self.buf.len() {
            return Err(self.bad(format!(
                "{} bytes left over after the message",
                self.buf.len() - self.at
            )));
        }
        Ok(())
    }
}

/// Decode a payload under a header that `frame::decode_header` accepted.
pub fn decode_payload(h: &Header, payload: &[u8]) -> Result<Message> {
    if payload.len() != h.len as usize {
        return Err(QkError::Transport(format!(
            "bad frame: {}: {} payload bytes, the header announces {}",
            h.op.name(),
            payload.len(),
            h.len
        )));
    }
    let mut r = Reader {
        buf: payload,
        at: 0,
        op: h.op,
    };
    let n = h.n as usize;
    let secret = h.flags & FLAG_SECRET != 0;
    let msg = match h.op {
        Op::Hello => Message::Hello(ClientHello {
            nonce: r.array32()?,
            name: r.str(MAX_NAME, "client name")?,
            takeover: h.flags & FLAG_TAKEOVER != 0,
            has_secret: secret,
        }),
        Op::Challenge => Message::Challenge(Challenge {
            nonce: r.array32()?,
            has_secret: secret,
        }),
        Op::Proof => Message::Proof(Proof {
            proof: if secret { Some(r.array32()?) } else { None },
        }),
        Op::HelloReply => {
            let chain = (0..n).map(|_| r.stage()).collect::<Result<Vec<_>>>()?;
            let proof = if secret { Some(r.array32()?) } else { None };
            Message::HelloReply(HelloReply { chain, proof })
        }
        Op::Run => Message::Run(Run {
            slot: h.slot,
            base: h.base,
            topk: h.arg,
            rows: r.rows(n, h.width)?,
        }),
        Op::RunReply => {
            let out = if h.width == 0 {
                RunOut::Ids {
                    ids: r.u32s(n)?,
                    topk: r.pairs(h.arg as usize)?,
                }
            } else {
                RunOut::Hidden(HiddenRows {
                    width: h.width,
                    data: r.f32s(n * h.width as usize)?,
                })
            };
            Message::RunReply(RunReply {
                slot: h.slot,
                base: h.base,
                out,
            })
        }
        Op::Step => {
            let entries = r.entries(n)?;
            Message::Step(Step {
                topk: h.arg,
                entries,
                rows: r.rows(n, h.width)?,
            })
        }
        Op::StepReply => {
            let entries = r.entries(n)?;
            let out = if h.width == 0 {
                let ids = r.u32s(n)?;
                let topk = (0..n)
                    .map(|_| r.pairs(h.arg as usize))
                    .collect::<Result<Vec<_>>>()?;
                StepOut::Ids { ids, topk }
            } else {
                StepOut::Hidden(HiddenRows {
                    width: h.width,
                    data: r.f32s(n * h.width as usize)?,
                })
            };
            Message::StepReply(StepReply { entries, out })
        }
        Op::Save => Message::Save {
            slot: h.slot,
            idx: h.arg,
        },
        Op::Load => Message::Load {
            slot: h.slot,
            idx: h.arg,
        },
        Op::Drop => Message::Drop { idx: h.arg },
        Op::Ack => {
            let code = r.u32()?;
            let of = u16::try_from(code)
                .ok()
                .and_then(Op::from_u16)
                .filter(|op| matches!(op, Op::Save | Op::Load | Op::Drop))
                .ok_or_else(|| r.bad(format!("acknowledged op {code} is not save, load or drop")))?;
            Message::Ack(Ack {
                of,
                slot: h.slot,
                idx: h.arg,
            })
        }
        Op::Error => {
            // The header check already refused unknown codes.
            let code = ErrorCode::from_u32(h.arg).ok_or_else(|| r.bad(format!("error code {}", h.arg)))?;
            let stage = r.str(MAX_NAME, "stage name")?;
            let message = r.str(MAX_MESSAGE, "error message")?;
            Message::Error(ErrorMsg { code, stage, message })
        }
        Op::Close => Message::Close,
        Op::Ping => Message::Ping { seq: h.arg },
        Op::Pong => Message::Pong { seq: h.arg },
    };
    r.end()?;
    Ok(msg)
}
