//! The head's link to the rest of the chain (docs/protocol.md): connect to the next stage with the head's
//! own description, check the whole chain, then RUN / STEP / SAVE / LOAD / DROP / PING as calls that
//! return the chain's final answer. A failed call marks the link down; the next call reconnects at
//! once (a request never waits out a backoff), while `reconnect_if_due` retries in the background
//! with exponential backoff. A reconnect is a new session (every stage reset its slots and dropped
//! its snapshots), and a stage whose boot id changed is reported as restarted.

use std::time::{Duration, Instant};

use crate::error::{QkError, Result};
use crate::transport::conn::{ClientConfig, Conn, Timeouts};
use crate::transport::frame::{ErrorCode, Op};
use crate::transport::hello::{StageDesc, chain_snapshot_entries};
use crate::transport::messages::{
    ErrorMsg, Message, Rows, Run, RunOut, RunReply, Step, StepEntry, StepOut, StepReply,
};

/// How the head reaches the chain.
#[derive(Clone, Debug)]
pub struct HeadConfig {
    /// host:port of stage 2.
    pub next: String,
    /// The head's own stage (layers [0, a)); the chain is checked against it. Its name is what the
    /// workers' logs and "busy" messages show.
    pub own: StageDesc,
    pub secret: Option<Vec<u8>>,
    /// Replace a live session on the chain instead of being refused as busy.
    pub takeover: bool,
    pub timeouts: Timeouts,
    /// Background retries wait `backoff_min`, doubling after each failed attempt up to `backoff_max`.
    pub backoff_min: Duration,
    pub backoff_max: Duration,
}

impl HeadConfig {
    pub fn new(next: &str, own: StageDesc) -> HeadConfig {
        HeadConfig {
            next: next.to_string(),
            own,
            secret: None,
            takeover: false,
            timeouts: Timeouts::default(),
            backoff_min: Duration::from_millis(250),
            backoff_max: Duration::from_secs(10),
        }
    }
}

/// The chain's answer to a RUN: n greedy ids and the top-k pairs of the final position.
#[derive(Clone, Debug, PartialEq)]
pub struct RunResult {
    pub ids: Vec<u32>,
    pub topk: Vec<(u32, f32)>,
}

/// The chain's answer to a STEP: one id and one top-k list per entry, in entry order.
#[derive(Clone, Debug, PartialEq)]
pub struct StepResult {
    pub ids: Vec<u32>,
    pub topk: Vec<Vec<(u32, f32)>>,
}

pub struct HeadLink {
    cfg: HeadConfig,
    conn: Option<Conn>,
    /// The chain of the latest session (stage 2 first); kept while down, to spot restarts.
    chain: Vec<StageDesc>,
    sessions: u64,
    restarted: Vec<String>,
    backoff: Duration,
    next_attempt: Option<Instant>,
    last_error: Option<String>,
    last_peer_error: Option<ErrorMsg>,
    ping_seq: u32,
}

impl HeadLink {
    /// A link that is down until the first call (or `connect`).
    pub fn new(cfg: HeadConfig) -> HeadLink {
        let backoff = cfg.backoff_min;
        HeadLink {
            cfg,
            conn: None,
            chain: Vec::new(),
            sessions: 0,
            restarted: Vec::new(),
            backoff,
            next_attempt: None,
            last_error: None,
            last_peer_error: None,
            ping_seq: 0,
        }
    }

    pub fn config(&self) -> &HeadConfig {
        &self.cfg
    }

    pub fn is_up(&self) -> bool {
        self.conn.is_some()
    }

    /// The chain after the head, as of the latest session.
    pub fn chain(&self) -> &[StageDesc] {
        &self.chain
    }

    /// Sessions established so far: each one started with every slot reset and no snapshots.
    pub fn sessions(&self) -> u64 {
        self.sessions
    }

    /// Snapshot entries usable on every stage of the chain, the head included.
    pub fn snapshot_entries(&self) -> u32 {
        chain_snapshot_entries(&self.cfg.own, &self.chain)
    }

    /// Names of the stages whose boot id changed at a reconnect since the last call (they restarted);
    /// cleared by the call.
    pub fn take_restarted(&mut self) -> Vec<String> {
        std::mem::take(&mut self.restarted)
    }

    /// Why the link last failed.
    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    /// The ERROR a stage sent in answer to the last failed call or hello, with its origin's name.
    pub fn last_peer_error(&self) -> Option<&ErrorMsg> {
        self.last_peer_error.as_ref()
    }

    /// While down: how long until a background retry is due.
    pub fn retry_in(&self) -> Option<Duration> {
        match (&self.conn, self.next_attempt) {
            (None, Some(at)) => Some(at.saturating_duration_since(Instant::now())),
            _ => None,
        }
    }

    /// Connect and hello now (closing a live session first); returns the chain after the head.
    pub fn connect(&mut self) -> Result<&[StageDesc]> {
        self.close();
        self.last_peer_error = None;
        let attempt = Conn::connect(&self.cfg.next, self.cfg.timeouts).and_then(|mut conn| {
            let client = ClientConfig {
                name: &self.cfg.own.name,
                secret: self.cfg.secret.as_deref(),
                takeover: self.cfg.takeover,
                own: Some(&self.cfg.own),
            };
            match conn.client_hello(&client) {
                Ok(chain) => Ok((conn, chain)),
                Err(e) => {
                    self.last_peer_error = conn.peer_error().cloned();
                    Err(e)
                }
            }
        });
        match attempt {
            Ok((conn, chain)) => {
                if !self.chain.is_empty() {
                    let known = |s: &StageDesc| {
                        self.chain
                            .iter()
                            .any(|old| old.name == s.name && old.boot_id == s.boot_id)
                    };
                    let fresh: Vec<String> = chain
                        .iter()
                        .filter(|s| !known(s))
                        .map(|s| s.name.clone())
                        .collect();
                    self.restarted.extend(fresh);
                }
                self.chain = chain;
                self.conn = Some(conn);
                self.sessions += 1;
                self.backoff = self.cfg.backoff_min;
                self.next_attempt = None;
                self.last_error = None;
                Ok(&self.chain)
            }
            Err(e) => {
                self.mark_down(&e);
                Err(e)
            }
        }
    }

    /// For a background ticker: reconnect if the link is down and its backoff has passed. None when
    /// nothing was attempted.
    pub fn reconnect_if_due(&mut self) -> Option<Result<()>> {
        if self.conn.is_some() || self.retry_in().is_some_and(|d| !d.is_zero()) {
            return None;
        }
        Some(self.connect().map(|_| ()))
    }

    fn mark_down(&mut self, err: &QkError) {
        self.conn = None;
        self.last_error = Some(err.to_string());
        self.next_attempt = Some(Instant::now() + self.backoff);
        self.backoff = self.backoff.saturating_mul(2).min(self.cfg.backoff_max);
    }

    /// End the session cleanly (CLOSE, then close); the next call reconnects.
    pub fn close(&mut self) {
        if let Some(mut conn) = self.conn.take() {
            conn.close();
        }
    }

    /// Send a request down the chain and return its reply, reconnecting first if the link is down.
    /// A stage's own failure (bad base, missing snapshot) leaves the link up; anything else marks it
    /// down.
    fn call(&mut self, msg: &Message) -> Result<Message> {
        if self.conn.is_none() {
            self.connect()?;
        }
        let Some(conn) = self.conn.as_mut() else {
            return Err(QkError::Transport(format!("{}: the link is down", self.cfg.next)));
        };
        match conn.request(msg) {
            Ok(reply) => {
                self.last_peer_error = None;
                Ok(reply)
            }
            Err(e) => {
                self.last_peer_error = conn.peer_error().cloned();
                if !self
                    .last_peer_error
                    .as_ref()
                    .is_some_and(|p| p.code == ErrorCode::Stage)
                {
                    self.mark_down(&e);
                }
                Err(e)
            }
        }
    }

    /// A reply that does not answer the request: the link can no longer be trusted.
    fn mismatch(&mut self, what: &str, got: &Message) -> QkError {
        let err = QkError::Transport(format!(
            "{}: the chain answered a {what} with a {} that does not match it",
            self.cfg.next,
            got.op().name()
        ));
        self.mark_down(&err);
        err
    }

    /// Positions [base, base + n) of `slot` (hidden rows from the head's layers, or token ids when
    /// the head embeds nothing itself); the chain's greedy ids and the final position's top-k.
    pub fn run(&mut self, slot: u32, base: u32, rows: Rows, topk: u32) -> Result<RunResult> {
        let request = Message::Run(Run {
            slot,
            base,
            topk,
            rows,
        });
        match self.call(&request)? {
            Message::RunReply(RunReply {
                slot: s,
                base: b,
                out: RunOut::Ids { ids, topk: pairs },
            }) if s == slot && b == base && ids.len() as u32 == request.rows() => {
                Ok(RunResult { ids, topk: pairs })
            }
            other => Err(self.mismatch("run", &other)),
        }
    }

    /// One decode position for each entry, `rows` one per entry.
    pub fn step(&mut self, entries: Vec<StepEntry>, rows: Rows, topk: u32) -> Result<StepResult> {
        let request = Message::Step(Step { topk, entries, rows });
        let reply = self.call(&request)?;
        let Message::Step(step) = &request else {
            return Err(QkError::Transport(
                "internal: a step request that is not a step".into(),
            ));
        };
        match reply {
            Message::StepReply(StepReply {
                entries,
                out: StepOut::Ids { ids, topk: pairs },
            }) if entries == step.entries => Ok(StepResult { ids, topk: pairs }),
            other => Err(self.mismatch("step", &other)),
        }
    }

    fn snapshot(&mut self, of: Op, slot: u32, idx: u32, request: Message) -> Result<()> {
        match self.call(&request)? {
            Message::Ack(ack) if ack.of == of && ack.slot == slot && ack.idx == idx => Ok(()),
            other => Err(self.mismatch(of.name(), &other)),
        }
    }

    /// Snapshot `slot` into entry `idx` on every stage after the head.
    pub fn save(&mut self, slot: u32, idx: u32) -> Result<()> {
        self.snapshot(Op::Save, slot, idx, Message::Save { slot, idx })
    }

    pub fn load(&mut self, slot: u32, idx: u32) -> Result<()> {
        self.snapshot(Op::Load, slot, idx, Message::Load { slot, idx })
    }

    pub fn drop_snapshot(&mut self, idx: u32) -> Result<()> {
        self.snapshot(Op::Drop, 0, idx, Message::Drop { idx })
    }

    /// Round-trip time through the whole chain (every stage forwards the ping).
    pub fn ping(&mut self) -> Result<Duration> {
        self.ping_seq = self.ping_seq.wrapping_add(1);
        let seq = self.ping_seq;
        let start = Instant::now();
        match self.call(&Message::Ping { seq })? {
            Message::Pong { seq: echoed } if echoed == seq => Ok(start.elapsed()),
            other => Err(self.mismatch("ping", &other)),
        }
    }
}
