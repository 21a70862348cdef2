//! The qkp frame header: the fixed 36 bytes every message starts with, in both directions, and the
//! header-level bound checks (payload length implied by the header, row/width/top-k caps). Pure bytes
//! in and out; no sockets. Payloads are encoded in `messages.rs`.
//!
//! # Byte layout (docs/protocol.md "Frame header"; every integer little-endian)
//!
//! ```text
//! offset size field    meaning
//!      0    4 magic    b"qkpf": "a qkp frame"; never changes
//!      4    4 version  u32 VERSION; must equal the reader's exactly
//!      8    2 op       u16 Op
//!     10    2 flags    u16, per-op bits (FLAG_*); unknown bits are refused
//!     12    4 slot     u32 engine slot (RUN, RUN_REPLY, SAVE, LOAD, ACK)
//!     16    4 n        u32 rows (RUN*), entries (STEP*), stages (HELLO_REPLY)
//!     20    4 base     u32 first position of the rows (RUN*)
//!     24    4 arg      u32 op argument: top-k (RUN, STEP, and k in their replies), snapshot index
//!                      (SAVE/LOAD/DROP/ACK), error code (ERROR), sequence number (PING/PONG)
//!     28    4 width    u32 floats per hidden row (n_embd); 0 means the rows are token ids
//!     32    4 len      u32 payload bytes that follow the header
//! ```
//!
//! A field an op does not use must be zero, so every frame has exactly one encoding and a mutated
//! frame is far more likely to be refused than misread. Payloads per op (all arrays little-endian):
//!
//! ```text
//! HELLO        C→W  nonce[32] · str name                       flags TAKEOVER | SECRET
//! CHALLENGE    W→C  nonce[32]                                  flags SECRET
//! PROOF        C→W  hmac[32] if flags has SECRET, else empty
//! HELLO_REPLY  W→C  n × stage · hmac[32] if flags has SECRET    (n = stages, this worker first)
//!              stage = str name · u64 boot_id · u32 layer_first · u32 layer_end · u32 n_layer ·
//!                      u32 n_embd · u32 slots · u32 ctx · u32 snap_entries · u64 snap_bytes ·
//!                      str fingerprint · str adapter
//! RUN          n × u32 token id (width 0) | n × width × f32 hidden rows; arg = top-k
//! RUN_REPLY    width 0: n × u32 greedy id · arg=k × (u32 id, f32 logit) of the final position
//!              width > 0: n × width × f32 hidden rows (arg 0)
//! STEP         n × (u32 slot, u32 base) · n × u32 token id | n × width × f32; arg = top-k
//! STEP_REPLY   n × (u32 slot, u32 base) · width 0: n × u32 id · n × k × (u32 id, f32 logit)
//!                                         width > 0: n × width × f32 (arg 0)
//! SAVE, LOAD   empty; slot, arg = snapshot index
//! DROP         empty; arg = snapshot index
//! ACK          u32 op acknowledged; slot and arg echo the request
//! ERROR        str stage · str message; arg = ErrorCode
//! CLOSE        empty
//! PING, PONG   empty; arg = sequence number, echoed
//! str          u16 byte length · UTF-8 bytes (capped: MAX_NAME for names, MAX_MESSAGE for messages)
//! ```
//!
//! # Version rules
//! Bytes 0..8 (magic, version) are frozen forever, so any two builds can tell they disagree and say
//! so with both numbers. Bump VERSION on any change to this header, an op, a flag, an error code or
//! a payload layout; nothing is negotiated, peers of different versions refuse each other at hello.
//! Versions 1–3 were the earlier pipe frames' magics ("qkp1".."qkp3"); this
//! layout starts at 4.

use crate::error::{QkError, Result};

pub const MAGIC: [u8; 4] = *b"qkpf";
pub const VERSION: u32 = 4;
pub const HEADER_LEN: usize = 36;

/// Rows per RUN frame and entries per STEP frame (docs/protocol.md "Limits").
pub const MAX_ROWS: u32 = 4096;
/// Floats per hidden row: n_embd of the largest supported shape with room to spare (Qwen3-Next 80B
/// has 2048). With MAX_ROWS this bounds one hidden payload at 256 MiB.
pub const MAX_WIDTH: u32 = 16384;
/// Top-k pairs returned per position (docs/protocol.md "Limits").
pub const MAX_TOPK: u32 = 256;
/// Stages in one chain description.
pub const MAX_STAGES: u32 = 64;
/// Bytes of a name-like string: stage and head names, model fingerprint (a hex SHA-256 is 64), adapter.
pub const MAX_NAME: usize = 128;
/// Bytes of an error message.
pub const MAX_MESSAGE: usize = 4096;
/// Bytes of a hello nonce and of an HMAC-SHA256 proof.
pub const NONCE_LEN: usize = 32;
pub const PROOF_LEN: usize = 32;

/// HELLO: force a takeover of a live head session.
pub const FLAG_TAKEOVER: u16 = 1;
/// HELLO / CHALLENGE: the sender has a shared secret; PROOF / HELLO_REPLY: a proof is attached.
pub const FLAG_SECRET: u16 = 2;

/// Smallest and largest encoded stage description (three strings between 0 and MAX_NAME bytes).
pub const STAGE_MIN_LEN: usize = 3 * 2 + 2 * 8 + 7 * 4;
pub const STAGE_MAX_LEN: usize = STAGE_MIN_LEN + 3 * MAX_NAME;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Op {
    Hello = 1,
    Challenge = 2,
    Proof = 3,
    HelloReply = 4,
    Run = 16,
    RunReply = 17,
    Step = 18,
    StepReply = 19,
    Save = 20,
    Load = 21,
    Drop = 22,
    Ack = 23,
    Error = 24,
    Close = 25,
    Ping = 26,
    Pong = 27,
}

impl Op {
    pub const ALL: [Op; 16] = [
        Op::Hello,
        Op::Challenge,
        Op::Proof,
        Op::HelloReply,
        Op::Run,
        Op::RunReply,
        Op::Step,
        Op::StepReply,
        Op::Save,
        Op::Load,
        Op::Drop,
        Op::Ack,
        Op::Error,
        Op::Close,
        Op::Ping,
        Op::Pong,
    ];

    pub fn from_u16(code: u16) -> Option<Op> {
        Op::ALL.into_iter().find(|op| *op as u16 == code)
    }

    pub fn name(self) -> &'static str {
        match self {
            Op::Hello => "hello",
            Op::Challenge => "challenge",
            Op::Proof => "proof",
            Op::HelloReply => "hello_reply",
            Op::Run => "run",
            Op::RunReply => "run_reply",
            Op::Step => "step",
            Op::StepReply => "step_reply",
            Op::Save => "save",
            Op::Load => "load",
            Op::Drop => "drop",
            Op::Ack => "ack",
            Op::Error => "error",
            Op::Close => "close",
            Op::Ping => "ping",
            Op::Pong => "pong",
        }
    }

    pub fn from_name(name: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|op| op.name() == name)
    }
}

/// Error codes carried in ERROR's `arg`. The display text is what an operator reads first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ErrorCode {
    Version = 1,
    Auth = 2,
    Busy = 3,
    BadFrame = 4,
    Chain = 5,
    Stage = 6,
    Timeout = 7,
    TakenOver = 8,
    Unavailable = 9,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 9] = [
        ErrorCode::Version,
        ErrorCode::Auth,
        ErrorCode::Busy,
        ErrorCode::BadFrame,
        ErrorCode::Chain,
        ErrorCode::Stage,
        ErrorCode::Timeout,
        ErrorCode::TakenOver,
        ErrorCode::Unavailable,
    ];

    pub fn from_u32(code: u32) -> Option<ErrorCode> {
        ErrorCode::ALL.into_iter().find(|c| *c as u32 == code)
    }

    /// Short name, used by the Python codec.
    pub fn name(self) -> &'static str {
        match self {
            ErrorCode::Version => "version",
            ErrorCode::Auth => "auth",
            ErrorCode::Busy => "busy",
            ErrorCode::BadFrame => "bad_frame",
            ErrorCode::Chain => "chain",
            ErrorCode::Stage => "stage",
            ErrorCode::Timeout => "timeout",
            ErrorCode::TakenOver => "taken_over",
            ErrorCode::Unavailable => "unavailable",
        }
    }

    pub fn from_name(name: &str) -> Option<ErrorCode> {
        ErrorCode::ALL.into_iter().find(|c| c.name() == name)
    }

    /// The words an error message starts with ("authentication failed: …", "busy: …").
    pub fn describe(self) -> &'static str {
        match self {
            ErrorCode::Version => "qkp version mismatch",
            ErrorCode::Auth => "authentication failed",
            ErrorCode::Busy => "busy",
            ErrorCode::BadFrame => "bad frame",
            ErrorCode::Chain => "chain refused",
            ErrorCode::Stage => "stage failure",
            ErrorCode::Timeout => "timeout",
            ErrorCode::TakenOver => "session taken over",
            ErrorCode::Unavailable => "downstream unavailable",
        }
    }
}

/// A decoded header. `magic` and `version` are implied (checked on decode, written on encode).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub op: Op,
    pub flags: u16,
    pub slot: u32,
    pub n: u32,
    pub base: u32,
    pub arg: u32,
    pub width: u32,
    pub len: u32,
}

impl Header {
    /// A header for `op` with every other field zero.
    pub fn new(op: Op) -> Header {
        Header {
            op,
            flags: 0,
            slot: 0,
            n: 0,
            base: 0,
            arg: 0,
            width: 0,
            len: 0,
        }
    }
}

/// Caps a reader applies on top of the protocol's own: a connection that knows its session's
/// n_embd (after hello) refuses wider rows before allocating for them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub max_rows: u32,
    pub max_width: u32,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_rows: MAX_ROWS,
            max_width: MAX_WIDTH,
        }
    }
}

fn bad(msg: String) -> QkError {
    QkError::Transport(format!("bad frame: {msg}"))
}

/// The message a reader gives when the peer speaks another version (names both numbers).
pub fn version_mismatch(peer: u32) -> String {
    format!("qkp version mismatch: the peer speaks version {peer}, this build speaks version {VERSION}")
}

pub fn encode_header(h: &Header) -> [u8; HEADER_LEN] {
    let mut out = [0u8; HEADER_LEN];
    out[0..4].copy_from_slice(&MAGIC);
    out[4..8].copy_from_slice(&VERSION.to_le_bytes());
    out[8..10].copy_from_slice(&(h.op as u16).to_le_bytes());
    out[10..12].copy_from_slice(&h.flags.to_le_bytes());
    let words = [h.slot, h.n, h.base, h.arg, h.width, h.len];
    for (i, w) in words.iter().enumerate() {
        out[12 + 4 * i..16 + 4 * i].copy_from_slice(&w.to_le_bytes());
    }
    out
}

fn le_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// The version of a frame with our magic but another version, if that is what `bytes` is: lets a
/// worker answer a foreign hello with an ERROR naming both versions instead of just closing.
pub fn foreign_version(bytes: &[u8]) -> Option<u32> {
    if bytes.len() < 8 || bytes[0..4] != MAGIC {
        return None;
    }
    let version = le_u32(bytes, 4);
    (version != VERSION).then_some(version)
}

/// Decode and check a header: magic, exact version, known op and flags, every bound, and that `len`
/// is what the other fields imply. Nothing is allocated from an unchecked length.
pub fn decode_header(bytes: &[u8], limits: &Limits) -> Result<Header> {
    if bytes.len() < HEADER_LEN {
        return Err(bad(format!(
            "header is {} bytes, expected {HEADER_LEN}",
            bytes.len()
        )));
    }
    if bytes[0..4] != MAGIC {
        return Err(bad(format!(
            "magic {:02x?} is not qkp's {:02x?}",
            &bytes[0..4],
            MAGIC
        )));
    }
    let version = le_u32(bytes, 4);
    if version != VERSION {
        return Err(QkError::Transport(version_mismatch(version)));
    }
    let op_code = u16::from_le_bytes([bytes[8], bytes[9]]);
    let op = Op::from_u16(op_code).ok_or_else(|| bad(format!("unknown op {op_code}")))?;
    let h = Header {
        op,
        flags: u16::from_le_bytes([bytes[10], bytes[11]]),
        slot: le_u32(bytes, 12),
        n: le_u32(bytes, 16),
        base: le_u32(bytes, 20),
        arg: le_u32(bytes, 24),
        width: le_u32(bytes, 28),
        len: le_u32(bytes, 32),
    };
    check_header(&h, limits)?;
    Ok(h)
}

/// How many payload bytes a header allows: exactly one count, or a range for the ops that carry
/// strings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PayloadLen {
    Exact(u64),
    Range(u64, u64),
}

/// Every header rule: fields an op does not use are zero, flags are known, counts are within their
/// caps, and `len` matches the payload the other fields imply. Shared by the decoder and the encoder.
pub fn check_header(h: &Header, limits: &Limits) -> Result<()> {
    let op = h.op.name();
    let allowed_flags = match h.op {
        Op::Hello => FLAG_TAKEOVER | FLAG_SECRET,
        Op::Challenge | Op::Proof | Op::HelloReply => FLAG_SECRET,
        _ => 0,
    };
    if h.flags & !allowed_flags != 0 {
        return Err(bad(format!(
            "{op}: unknown flags {:#06x}",
            h.flags & !allowed_flags
        )));
    }
    let zero = |field: &str, value: u32| -> Result<()> {
        if value != 0 {
            return Err(bad(format!("{op}: field {field} must be 0, got {value}")));
        }
        Ok(())
    };
    let rows = |n: u32| -> Result<u64> {
        if n == 0 || n > limits.max_rows.min(MAX_ROWS) {
            return Err(bad(format!(
                "{op}: n = {n}, allowed 1..={}",
                limits.max_rows.min(MAX_ROWS)
            )));
        }
        Ok(n as u64)
    };
    let width = |w: u32| -> Result<u64> {
        if w > limits.max_width.min(MAX_WIDTH) {
            return Err(bad(format!(
                "{op}: row width {w} exceeds {}",
                limits.max_width.min(MAX_WIDTH)
            )));
        }
        Ok(w as u64)
    };
    let topk = |k: u32| -> Result<u64> {
        if k > MAX_TOPK {
            return Err(bad(format!("{op}: top-k {k} exceeds {MAX_TOPK}")));
        }
        Ok(k as u64)
    };
    // Bytes of n rows: token ids (width 0) or f32 hidden rows.
    let row_bytes = |n: u64, w: u64| if w == 0 { n * 4 } else { n * w * 4 };
    let secret = h.flags & FLAG_SECRET != 0;
    let proof = if secret { PROOF_LEN as u64 } else { 0 };
    let str_len = |cap: usize| 2 + cap as u64;

    let expected = match h.op {
        Op::Hello => {
            for (f, v) in [
                ("slot", h.slot),
                ("n", h.n),
                ("base", h.base),
                ("arg", h.arg),
                ("width", h.width),
            ] {
                zero(f, v)?;
            }
            PayloadLen::Range(NONCE_LEN as u64 + 2, NONCE_LEN as u64 + str_len(MAX_NAME))
        }
        Op::Challenge | Op::Proof => {
            for (f, v) in [
                ("slot", h.slot),
                ("n", h.n),
                ("base", h.base),
                ("arg", h.arg),
                ("width", h.width),
            ] {
                zero(f, v)?;
            }
            match h.op {
                Op::Challenge => PayloadLen::Exact(NONCE_LEN as u64),
                _ => PayloadLen::Exact(proof),
            }
        }
        Op::HelloReply => {
            for (f, v) in [
                ("slot", h.slot),
                ("base", h.base),
                ("arg", h.arg),
                ("width", h.width),
            ] {
                zero(f, v)?;
            }
            if h.n == 0 || h.n > MAX_STAGES {
                return Err(bad(format!("{op}: {} stages, allowed 1..={MAX_STAGES}", h.n)));
            }
            let n = h.n as u64;
            PayloadLen::Range(n * STAGE_MIN_LEN as u64 + proof, n * STAGE_MAX_LEN as u64 + proof)
        }
        Op::Run => {
            let n = rows(h.n)?;
            if h.base.checked_add(h.n).is_none() {
                return Err(bad(format!("{op}: base {} + n {} overflows u32", h.base, h.n)));
            }
            topk(h.arg)?;
            PayloadLen::Exact(row_bytes(n, width(h.width)?))
        }
        Op::RunReply => {
            let n = rows(h.n)?;
            let w = width(h.width)?;
            let k = topk(h.arg)?;
            if w > 0 {
                zero("arg", h.arg)?;
            }
            PayloadLen::Exact(row_bytes(n, w) + if w == 0 { k * 8 } else { 0 })
        }
        Op::Step => {
            zero("slot", h.slot)?;
            zero("base", h.base)?;
            let n = rows(h.n)?;
            topk(h.arg)?;
            PayloadLen::Exact(n * 8 + row_bytes(n, width(h.width)?))
        }
        Op::StepReply => {
            zero("slot", h.slot)?;
            zero("base", h.base)?;
            let n = rows(h.n)?;
            let w = width(h.width)?;
            let k = topk(h.arg)?;
            if w > 0 {
                zero("arg", h.arg)?;
            }
            PayloadLen::Exact(n * 8 + row_bytes(n, w) + if w == 0 { n * k * 8 } else { 0 })
        }
        Op::Save | Op::Load | Op::Drop | Op::Ack => {
            for (f, v) in [("n", h.n), ("base", h.base), ("width", h.width)] {
                zero(f, v)?;
            }
            if h.op == Op::Drop {
                zero("slot", h.slot)?;
            }
            PayloadLen::Exact(if h.op == Op::Ack { 4 } else { 0 })
        }
        Op::Error => {
            for (f, v) in [("slot", h.slot), ("n", h.n), ("base", h.base), ("width", h.width)] {
                zero(f, v)?;
            }
            if ErrorCode::from_u32(h.arg).is_none() {
                return Err(bad(format!("{op}: unknown error code {}", h.arg)));
            }
            PayloadLen::Range(4, str_len(MAX_NAME) + str_len(MAX_MESSAGE))
        }
        Op::Close | Op::Ping | Op::Pong => {
            for (f, v) in [("slot", h.slot), ("n", h.n), ("base", h.base), ("width", h.width)] {
                zero(f, v)?;
            }
            if h.op == Op::Close {
                zero("arg", h.arg)?;
            }
            PayloadLen::Exact(0)
        }
    };
    let len = h.len as u64;
    match expected {
        PayloadLen::Exact(want) if len != want => Err(bad(format!(
            "{op}: payload is {len} bytes, the header implies {want}"
        ))),
        PayloadLen::Range(lo, hi) if len < lo || len > hi => {
            Err(bad(format!("{op}: payload is {len} bytes, allowed {lo}..={hi}")))
        }
        _ => Ok(()),
    }
}
