//! The head of a split (docs/architecture.md "Split serving"): the head's own layers (a `Stage`) and
//! one link thread that carries every call to the chain in order (qkp is request → reply per
//! session, so one FIFO keeps each slot's positions in order on every stage). The hidden rows the
//! head's layers produce go from the stage's readback straight into the qkp frame, never through
//! Python: a prompt is cut into pieces at absolute multiples of `piece` positions and piece i goes
//! down the chain while the head computes piece i + 1; a decode step runs the head's layers on the
//! calling thread and hands its rows to the link thread, returning a `Pending` the caller collects
//! later, so two groups of slots can be in flight (one on the head, one on the chain). A chained
//! step runs entirely on the link thread: as soon as the chain has answered the step before it, the
//! head's layers run on those greedy ids and the rows go down the chain, without waiting for the
//! caller to collect that answer and hand the ids back.
//!
//! While idle the link thread looks after the link: every `tick` it reconnects a down link once its
//! backoff has passed, takes in what the chain sent unasked (a takeover notice), and pings a chain
//! idle for `ping_idle`. What it learns is kept in a `ChainStatus` that readers copy without ever
//! waiting for a call in flight.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::error::{QkError, Result};
use crate::transport::head::{HeadLink, RunResult, StepResult};
use crate::transport::hello::StageDesc;
use crate::transport::messages::{HiddenRows, Rows, RunOut, StepEntry, StepOut};
use crate::transport::stage::Stage;

/// How the pipeline cuts prompts and looks after an idle link.
#[derive(Clone, Copy, Debug)]
pub struct SplitConfig {
    /// Positions per prefill piece: a multiple of 64 (the DeltaNet chunk), so where a prompt is cut
    /// changes no result, and small enough that the next stage starts early.
    pub piece: u32,
    /// Idle time after which the link thread looks after the link; None: never (tests drive it).
    pub tick: Option<Duration>,
    /// Idle time after which a tick pings the chain.
    pub ping_idle: Duration,
}

impl Default for SplitConfig {
    fn default() -> SplitConfig {
        SplitConfig {
            piece: 128,
            tick: Some(Duration::from_secs(1)),
            ping_idle: Duration::from_secs(5),
        }
    }
}

/// Decode steps through the pipeline, summed: where a step's time goes (`benches/split_bench.py`
/// prints the means).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTotals {
    pub steps: u64,
    /// Slots stepped, over all steps.
    pub rows: u64,
    /// The head's own layers (the calling thread, up to the rows handed to the link).
    pub head: Duration,
    /// Waiting on the link thread behind earlier calls.
    pub queued: Duration,
    /// The chain's round trip after the head: send, every later stage, the reply.
    pub chain: Duration,
}

/// The link's state as of its latest call or tick.
#[derive(Clone, Debug, Default)]
pub struct ChainStatus {
    pub up: bool,
    /// Sessions established so far: each began with every stage's slots reset and no snapshots.
    pub sessions: u64,
    /// The chain after the head, as of the latest session.
    pub chain: Vec<StageDesc>,
    /// Snapshot entries usable on every stage, the head included.
    pub snapshot_entries: u32,
    pub last_error: Option<String>,
    /// While down: when the background retry is due.
    pub retry_at: Option<Instant>,
    /// "taken over by head 'X' at T" while another head holds the chain this head lost to it.
    pub taken_over: Option<String>,
    /// Stages that restarted (changed boot id) at a reconnect, until taken.
    pub restarted: Vec<String>,
    /// Round trip of the latest idle ping through the whole chain.
    pub ping: Option<Duration>,
    /// The latest decode step's round trip through the chain after the head.
    pub step_rtt: Option<Duration>,
    pub totals: StepTotals,
}

type Job = Box<dyn FnOnce(&mut LinkThread) + Send>;

/// A call handed to the link thread; `wait` returns its answer.
pub struct Pending<T> {
    rx: Receiver<Result<T>>,
}

impl<T> Pending<T> {
    /// Block until the chain has answered.
    pub fn wait(self) -> Result<T> {
        self.rx.recv().unwrap_or_else(|_| Err(gone()))
    }

    /// The answer if it has come (`Err(self)` while it has not).
    pub fn try_wait(self) -> std::result::Result<Result<T>, Pending<T>> {
        match self.rx.try_recv() {
            Ok(r) => Ok(r),
            Err(mpsc::TryRecvError::Empty) => Err(self),
            Err(mpsc::TryRecvError::Disconnected) => Ok(Err(gone())),
        }
    }
}

fn gone() -> QkError {
    QkError::Transport("the split head's link thread ended before answering".into())
}

/// What the link thread owns: the link (shared with its Python handle, which reads it between
/// calls), the status it keeps current, and when it last carried a call.
struct LinkThread {
    link: Arc<Mutex<HeadLink>>,
    status: Arc<Mutex<ChainStatus>>,
    last_call: Instant,
    ping_idle: Duration,
    /// The slots and greedy ids of the decode step the chain answered last, while no other call
    /// has come since: what a chained step feeds the head.
    last_step: Option<(Vec<u32>, Vec<u32>)>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Each guarded value stays consistent between statements: a panic elsewhere leaves it usable.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A failure of the chain, as the HTTP client sees it: which part failed, and why.
fn pipeline_error(e: QkError) -> QkError {
    match e {
        QkError::Transport(m) => QkError::Transport(format!("pipeline stage failed: {m}")),
        other => other,
    }
}

impl LinkThread {
    /// One call on the link; `retry` repeats it once on a new session when the link went down
    /// under it (a chain restarted while idle costs no request). Calls that may be repeated start
    /// a sequence at base 0 or restore a snapshot (which then fails cleanly).
    fn call<T>(&mut self, retry: bool, mut f: impl FnMut(&mut HeadLink) -> Result<T>) -> Result<T> {
        let link = Arc::clone(&self.link);
        let mut link = lock(&link);
        let mut out = f(&mut link);
        if out.is_err() && retry && !link.is_up() {
            out = f(&mut link);
        }
        self.note(&mut link);
        self.last_call = Instant::now();
        out.map_err(pipeline_error)
    }

    /// Connect and hello now; a refusal keeps the chain's own words.
    fn connect(&mut self) -> Result<Vec<StageDesc>> {
        let link = Arc::clone(&self.link);
        let mut link = lock(&link);
        let out = link.connect().map(<[StageDesc]>::to_vec);
        self.note(&mut link);
        self.last_call = Instant::now();
        out
    }

    /// Copy what the link knows into the status.
    fn note(&self, link: &mut HeadLink) {
        let restarted = link.take_restarted();
        let mut st = lock(&self.status);
        if st.sessions != link.sessions() || st.chain.len() != link.chain().len() {
            st.chain = link.chain().to_vec();
        }
        st.up = link.is_up();
        st.sessions = link.sessions();
        st.snapshot_entries = link.snapshot_entries();
        st.last_error = link.last_error().map(str::to_string);
        st.retry_at = link.retry_in().map(|d| Instant::now() + d);
        st.taken_over = link.taken_over().map(str::to_string);
        st.restarted.extend(restarted);
    }

    /// An idle moment: reconnect a down link whose backoff has passed, else take in what the chain
    /// sent unasked, else ping a chain idle for `ping_idle`.
    fn tick(&mut self) {
        let link = Arc::clone(&self.link);
        let mut link = lock(&link);
        if !link.is_up() {
            // A failure is kept in the link's last error (the status shows it).
            let _ = link.reconnect_if_due();
        } else if link.poll() && self.last_call.elapsed() >= self.ping_idle {
            if let Ok(rtt) = link.ping() {
                lock(&self.status).ping = Some(rtt);
            }
            self.last_call = Instant::now();
        }
        self.note(&mut link);
    }

    /// The chain's part of a decode step whose head layers gave `hidden` (`head` long, handed over
    /// at `handed`); keeps the slots' greedy ids for a chained step.
    fn chain_step(
        &mut self,
        entries: Vec<StepEntry>,
        hidden: HiddenRows,
        topk: u32,
        head: Duration,
        handed: Instant,
    ) -> Result<StepResult> {
        let sent = Instant::now();
        let slots: Vec<u32> = entries.iter().map(|e| e.slot).collect();
        let rows = entries.len() as u64;
        let mut request = Some((entries, hidden));
        let out = self.call(false, |l| {
            let (entries, hidden) = request.take().ok_or_else(gone)?;
            l.step(entries, Rows::Hidden(hidden), topk)
        });
        let chain = sent.elapsed();
        {
            let mut st = lock(&self.status);
            st.step_rtt = Some(chain);
            let totals = &mut st.totals;
            totals.steps += 1;
            totals.rows += rows;
            totals.head += head;
            totals.queued += sent - handed;
            totals.chain += chain;
        }
        self.last_step = out.as_ref().ok().map(|r| (slots, r.ids.clone()));
        out
    }

    fn serve(mut self, jobs: &Receiver<Job>, tick: Option<Duration>) {
        loop {
            let job = match tick {
                Some(t) => jobs.recv_timeout(t),
                None => jobs.recv().map_err(|_| RecvTimeoutError::Disconnected),
            };
            match job {
                Ok(job) => job(&mut self),
                Err(RecvTimeoutError::Timeout) => self.tick(),
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        let link = Arc::clone(&self.link);
        let mut link = lock(&link);
        link.close();
        self.note(&mut link);
    }
}

/// `[base, base + n)` cut at absolute multiples of `piece`: (start offset, length) pairs.
pub fn pieces(base: u32, n: u32, piece: u32) -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    let (mut pos, end) = (u64::from(base), u64::from(base) + u64::from(n));
    let piece = u64::from(piece.max(1));
    while pos < end {
        let stop = end.min((pos / piece + 1) * piece);
        out.push(((pos - u64::from(base)) as u32, (stop - pos) as u32));
        pos = stop;
    }
    out
}

pub struct SplitHead {
    /// Shared with the link thread, which runs the head's layers of a chained step.
    stage: Arc<Mutex<Box<dyn Stage + Send>>>,
    jobs: Mutex<Option<Sender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    status: Arc<Mutex<ChainStatus>>,
    piece: u32,
}

impl SplitHead {
    /// The head's layers `stage` in front of the chain behind `link`; starts the link thread.
    pub fn new(
        stage: Box<dyn Stage + Send>,
        link: Arc<Mutex<HeadLink>>,
        cfg: SplitConfig,
    ) -> Result<SplitHead> {
        if cfg.piece == 0 || !cfg.piece.is_multiple_of(64) {
            return Err(QkError::Transport(format!(
                "prefill piece {} is not a positive multiple of 64",
                cfg.piece
            )));
        }
        let info = stage.describe()?;
        if info.layer_first != 0 || info.is_last() {
            return Err(QkError::Transport(format!(
                "a split head runs layers [0, a) with a < n_layer; this stage runs [{}, {}) of {}",
                info.layer_first, info.layer_end, info.n_layer
            )));
        }
        let status = Arc::new(Mutex::new(ChainStatus::default()));
        let thread = LinkThread {
            link,
            status: Arc::clone(&status),
            last_call: Instant::now(),
            ping_idle: cfg.ping_idle,
            last_step: None,
        };
        {
            let link = Arc::clone(&thread.link);
            thread.note(&mut lock(&link));
        }
        let (tx, rx) = mpsc::channel::<Job>();
        let handle = thread::Builder::new()
            .name("qk-link".into())
            .spawn(move || thread.serve(&rx, cfg.tick))
            .map_err(|e| QkError::Transport(format!("starting the link thread: {e}")))?;
        Ok(SplitHead {
            stage: Arc::new(Mutex::new(stage)),
            jobs: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(handle)),
            status,
            piece: cfg.piece,
        })
    }

    /// Hand `f` to the link thread. Any call but a decode step ends what a chained step could
    /// follow.
    fn send<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut LinkThread) -> Result<T> + Send + 'static,
    ) -> Result<Pending<T>> {
        self.send_job(move |link| {
            link.last_step = None;
            f(link)
        })
    }

    fn send_job<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut LinkThread) -> Result<T> + Send + 'static,
    ) -> Result<Pending<T>> {
        let (tx, rx) = mpsc::sync_channel(1);
        let job: Job = Box::new(move |link| {
            let _ = tx.send(f(link));
        });
        match lock(&self.jobs).as_ref() {
            Some(jobs) if jobs.send(job).is_ok() => Ok(Pending { rx }),
            _ => Err(QkError::Transport(
                "this split head is closed: make a new one for a new session".into(),
            )),
        }
    }

    fn stage(&self) -> MutexGuard<'_, Box<dyn Stage + Send>> {
        lock(&self.stage)
    }

    /// The head's layers for one position of each of `slots` fed `tokens`: the step's entries (each
    /// slot at its next position) and the rows for the chain.
    fn head_step(
        stage: &Mutex<Box<dyn Stage + Send>>,
        slots: &[u32],
        tokens: Vec<u32>,
    ) -> Result<(Vec<StepEntry>, HiddenRows)> {
        let mut stage = lock(stage);
        let entries = slots
            .iter()
            .map(|&slot| {
                Ok(StepEntry {
                    slot,
                    base: stage.position(slot)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        match stage.step(&entries, &Rows::Tokens(tokens), 0)? {
            StepOut::Hidden(h) => Ok((entries, h)),
            StepOut::Ids { .. } => Err(QkError::Engine(
                "the head's stage answered ids: it must not end the model".into(),
            )),
        }
    }

    /// The link's state as of its latest call or tick; never waits for a call in flight.
    pub fn status(&self) -> ChainStatus {
        lock(&self.status).clone()
    }

    /// Sessions established so far (cheaper than `status` when that is all a caller needs).
    pub fn sessions(&self) -> u64 {
        lock(&self.status).sessions
    }

    /// Names of the stages that restarted at a reconnect since the last call.
    pub fn take_restarted(&self) -> Vec<String> {
        std::mem::take(&mut lock(&self.status).restarted)
    }

    /// Connect and hello now (ending a live session first); the chain after the head.
    pub fn connect(&self) -> Result<Vec<StageDesc>> {
        self.send(LinkThread::connect)?.wait()
    }

    /// Positions `[base, base + n)` of `slot` from token ids: the head's layers piece by piece, each
    /// piece's rows down the chain while the next is computed. Returns the chain's greedy ids of
    /// the final piece and the top-k of the final position. Every piece sent is answered before
    /// this returns, so no reply is left to land on a later call.
    pub fn prefill(&self, slot: u32, tokens: &[u32], base: u32, topk: u32) -> Result<RunResult> {
        let n = u32::try_from(tokens.len())
            .map_err(|_| QkError::Engine(format!("a prompt of {} tokens", tokens.len())))?;
        if n == 0 {
            return Err(QkError::Engine("prefill of no tokens".into()));
        }
        // A piece that failed on the chain makes the later ones pointless (their bases no longer
        // continue anything); they are answered with that failure instead of being sent.
        let failed = Arc::new(AtomicBool::new(false));
        let mut sent = Vec::new();
        let mut head_error = None;
        {
            let mut stage = self.stage();
            for (offset, len) in pieces(base, n, self.piece) {
                if failed.load(Ordering::SeqCst) {
                    break;
                }
                let start = base + offset;
                let rows = Rows::Tokens(tokens[offset as usize..(offset + len) as usize].to_vec());
                let hidden = match stage.run(slot, start, &rows, 0) {
                    Ok(RunOut::Hidden(h)) => h,
                    Ok(RunOut::Ids { .. }) => {
                        head_error = Some(QkError::Engine(
                            "the head's stage answered ids: it must not end the model".into(),
                        ));
                        break;
                    }
                    Err(e) => {
                        head_error = Some(e);
                        break;
                    }
                };
                let k = if offset + len == n { topk } else { 0 };
                let failed = Arc::clone(&failed);
                let piece = self.send(move |t| {
                    if failed.load(Ordering::SeqCst) {
                        return Err(QkError::Transport(format!(
                            "pipeline stage failed: an earlier piece of slot {slot}'s prompt failed"
                        )));
                    }
                    // Only a piece at base 0 may be sent twice (on a new session): only it keeps a copy.
                    let mut rows = Some(Rows::Hidden(hidden));
                    let out = t.call(start == 0, |l| {
                        let r = if start == 0 { rows.clone() } else { rows.take() };
                        l.run(slot, start, r.ok_or_else(gone)?, k)
                    });
                    if out.is_err() {
                        failed.store(true, Ordering::SeqCst);
                    }
                    out
                });
                match piece {
                    Ok(p) => sent.push(p),
                    Err(e) => {
                        head_error = Some(e);
                        break;
                    }
                }
            }
        }
        let mut last = None;
        let mut first_error = None;
        for p in sent {
            match p.wait() {
                Ok(r) => last = Some(r),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        // The head's own failure first: a lost device must reach the scheduler as such.
        if let Some(e) = head_error.or(first_error) {
            return Err(e);
        }
        last.ok_or_else(|| QkError::Transport("prefill: the chain answered no piece".into()))
    }

    /// One decode position for each of `slots` (distinct), `tokens` one per slot: the head's layers
    /// now, then the rows to the chain. The chain's answer comes through the returned `Pending`.
    pub fn step(&self, slots: &[u32], tokens: &[u32], topk: u32) -> Result<Pending<StepResult>> {
        let started = Instant::now();
        if slots.len() != tokens.len() || slots.is_empty() {
            return Err(QkError::Engine(format!(
                "step: {} slots and {} tokens",
                slots.len(),
                tokens.len()
            )));
        }
        let (entries, hidden) = SplitHead::head_step(&self.stage, slots, tokens.to_vec())?;
        let handed = Instant::now();
        let head = handed - started;
        self.send(move |t| t.chain_step(entries, hidden, topk, head, handed))
    }

    /// The decode step after the latest one (over the same `slots`, with no other call between),
    /// each slot fed the greedy id the chain answered for it: the head's layers run on the link
    /// thread as soon as that answer is in, so the caller may collect it later. Fails if the step
    /// before failed or was over other slots.
    pub fn step_chained(&self, slots: &[u32], topk: u32) -> Result<Pending<StepResult>> {
        let stage = Arc::clone(&self.stage);
        let slots = slots.to_vec();
        self.send_job(move |t| {
            let started = Instant::now();
            let tokens = match t.last_step.take() {
                Some((before, ids)) if before == slots => ids,
                _ => {
                    return Err(QkError::Engine(
                        "a chained step follows a decode step over the same slots that the chain \
                         answered, with no other call between"
                            .into(),
                    ));
                }
            };
            let (entries, hidden) = SplitHead::head_step(&stage, &slots, tokens)?;
            let handed = Instant::now();
            t.chain_step(entries, hidden, topk, handed - started, handed)
        })
    }

    /// Snapshot `slot` into entry `idx` on the head, then on every stage of the chain.
    pub fn save(&self, slot: u32, idx: u32) -> Result<()> {
        self.stage().save(slot, idx)?;
        self.send(move |t| t.call(false, |l| l.save(slot, idx)))?.wait()
    }

    /// Restore entry `idx` into `slot` on the head, then on every stage of the chain.
    pub fn load(&self, slot: u32, idx: u32) -> Result<()> {
        self.stage().load(slot, idx)?;
        self.send(move |t| t.call(true, |l| l.load(slot, idx)))?.wait()
    }

    /// Free entry `idx` on the head and, while the link is up, on the chain (a session that ended
    /// took every snapshot of the chain with it).
    pub fn drop_snapshot(&self, idx: u32) -> Result<()> {
        self.stage().drop_snapshot(idx)?;
        if !lock(&self.status).up {
            return Ok(());
        }
        self.send(move |t| t.call(false, |l| l.drop_snapshot(idx)))?
            .wait()
    }

    /// End the session cleanly and stop the link thread (after the calls already handed to it).
    pub fn close(&self) {
        lock(&self.jobs).take();
        if let Some(handle) = lock(&self.thread).take() {
            let _ = handle.join();
        }
    }
}

impl Drop for SplitHead {
    fn drop(&mut self) {
        self.close();
    }
}
