//! The worker's serve loop (docs/protocol.md): accept head sessions one at a time behind a `SessionGate`,
//! answer the hello with this stage's description plus the chain learned from its own downstream
//! connection, then serve RUN / STEP / SAVE / LOAD / DROP / PING / CLOSE against a local `Stage`,
//! forwarding hidden rows and snapshot operations down the chain and relaying the answers back.
//!
//! Threads: an acceptor polls the listener and runs each connection's hello on its own thread (so a
//! second head is told "busy" while a session is served, and a slow hello never blocks the next);
//! at most `max_pending` hellos run at once, each given `Timeouts::pre_auth` to prove the secret,
//! and a connection beyond that is refused at once, so idle or hostile sockets cannot pile up
//! threads. Admitted sessions are handed to the calling thread, the only one that touches the
//! stage; between requests it watches for a takeover, which ends the session with a "taken over"
//! ERROR to the head that lost it. A bad frame, a dead peer or a dead downstream ends that session
//! with a `[qk.worker]` line on stderr; the worker goes on accepting until `WorkerControl::stop`.

use std::collections::HashMap;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::thread;
use std::time::Duration;

use crate::error::{QkError, Result};
use crate::transport::auth;
use crate::transport::conn::{
    ClientConfig, Conn, ServerConfig, ServerHandshake, SessionGate, SessionTicket, Timeouts,
};
use crate::transport::frame::{ErrorCode, Op};
use crate::transport::hello::StageDesc;
use crate::transport::messages::encode;
use crate::transport::messages::{
    Ack, ErrorMsg, Message, Rows, Run, RunOut, RunReply, Step, StepOut, StepReply,
};
use crate::transport::stage::Stage;

/// How often the acceptor looks for a new connection or a stop request.
const ACCEPT_POLL: Duration = Duration::from_millis(10);
/// How often an idle session looks for a takeover or a stop between requests.
const SESSION_POLL: Duration = Duration::from_millis(100);
/// Connections in their hello at once, by default: heads and upstream stages connect one at a time
/// (and retry with backoff), so more than a handful waiting means someone is holding sockets open.
pub const MAX_PENDING: usize = 16;

/// How a worker serves.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// This stage's name in hellos, errors and logs (e.g. "gpu2:18100").
    pub name: String,
    /// The shared secret both hops of this worker prove (docs/protocol.md "Shared-secret proof"); None: no proofs.
    pub secret: Option<Vec<u8>>,
    /// host:port of the next stage; None for the stage that ends the model.
    pub next: Option<String>,
    /// Connect to the next stage with takeover, replacing a session it still holds for this stage
    /// (after this worker restarted, the next one may not have noticed the old connection die yet).
    pub takeover_next: bool,
    pub timeouts: Timeouts,
    /// Connections allowed in their hello at once; more are refused "busy" at accept.
    pub max_pending: usize,
}

impl WorkerConfig {
    pub fn new(name: &str) -> WorkerConfig {
        WorkerConfig {
            name: name.to_string(),
            secret: None,
            next: None,
            takeover_next: true,
            timeouts: Timeouts::default(),
            max_pending: MAX_PENDING,
        }
    }
}

/// Stops a running `serve_worker` from another thread: no new connections are accepted and every
/// open one (hellos in progress, the session, the downstream hop) is shut, so `serve_worker` returns.
#[derive(Clone, Default)]
pub struct WorkerControl {
    inner: Arc<ControlState>,
}

#[derive(Default)]
struct ControlState {
    stop: AtomicBool,
    next_id: AtomicU64,
    open: Mutex<HashMap<u64, TcpStream>>,
}

fn lock_open(state: &ControlState) -> MutexGuard<'_, HashMap<u64, TcpStream>> {
    // The map only holds socket clones; one left behind by a panic is still usable.
    state.open.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl WorkerControl {
    pub fn new() -> WorkerControl {
        WorkerControl::default()
    }

    pub fn stop(&self) {
        self.inner.stop.store(true, Ordering::SeqCst);
        for stream in lock_open(&self.inner).values() {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    pub fn is_stopped(&self) -> bool {
        self.inner.stop.load(Ordering::SeqCst)
    }

    /// Remember `stream` so `stop` can shut it; forgotten when the guard drops.
    fn track(&self, stream: &TcpStream) -> Tracked {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        if let Ok(clone) = stream.try_clone() {
            lock_open(&self.inner).insert(id, clone);
        }
        // A stop that raced with the insert above must still reach this stream.
        if self.is_stopped() {
            let _ = stream.shutdown(Shutdown::Both);
        }
        Tracked {
            control: self.clone(),
            id,
        }
    }
}

struct Tracked {
    control: WorkerControl,
    id: u64,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        lock_open(&self.control.inner).remove(&self.id);
    }
}

fn log(name: &str, what: impl std::fmt::Display) {
    eprintln!("[qk.worker] {name}: {what}");
}

/// A session that passed the hello's authentication and the session gate, waiting for its reply.
struct Admitted {
    conn: Conn,
    handshake: ServerHandshake,
    ticket: SessionTicket,
    _tracked: Tracked,
}

/// Serve `stage` on `listener` until `control.stop()`. Fails only if the stage cannot describe
/// itself or its description does not fit the configuration; every connection-level failure is
/// logged and the worker keeps serving.
pub fn serve_worker(
    listener: &TcpListener,
    stage: &mut dyn Stage,
    cfg: &WorkerConfig,
    control: &WorkerControl,
) -> Result<()> {
    let info = stage.describe()?;
    match (&cfg.next, info.is_last()) {
        (None, false) => {
            return Err(QkError::Transport(format!(
                "stage '{}' runs layers [{}, {}) of {}: a stage that does not end the model needs a next stage",
                cfg.name, info.layer_first, info.layer_end, info.n_layer
            )));
        }
        (Some(next), true) => {
            return Err(QkError::Transport(format!(
                "stage '{}' runs the last layers [{}, {}) of {}, yet a next stage ({next}) is configured",
                cfg.name, info.layer_first, info.layer_end, info.n_layer
            )));
        }
        _ => {}
    }
    let own = info.describe_as(&cfg.name, auth::boot_id()?);
    listener
        .set_nonblocking(true)
        .map_err(|e| QkError::Transport(format!("listener: setting non-blocking: {e}")))?;
    let local = listener
        .local_addr()
        .map_or_else(|_| "?".to_string(), |a| a.to_string());
    log(
        &cfg.name,
        format_args!(
            "serving layers [{}, {}) of {} on {local}{}",
            own.layer_first,
            own.layer_end,
            own.n_layer,
            cfg.next
                .as_ref()
                .map_or(String::new(), |n| format!(", next stage {n}"))
        ),
    );
    let gate = SessionGate::new();
    let (tx, rx) = mpsc::channel::<Admitted>();
    thread::scope(|scope| {
        let gate = &gate;
        scope.spawn(move || accept_loop(scope, listener, cfg, control, gate, tx));
        let mut server = Server {
            stage,
            own: &own,
            cfg,
            control,
            down: None,
        };
        // Ends when the acceptor and every hello thread are gone (after a stop).
        while let Ok(admitted) = rx.recv() {
            if control.is_stopped() {
                continue;
            }
            server.session(admitted);
        }
    });
    let _ = listener.set_nonblocking(false);
    log(&cfg.name, "stopped");
    Ok(())
}

fn accept_loop<'scope>(
    scope: &'scope thread::Scope<'scope, '_>,
    listener: &'scope TcpListener,
    cfg: &'scope WorkerConfig,
    control: &'scope WorkerControl,
    gate: &'scope SessionGate,
    tx: mpsc::Sender<Admitted>,
) {
    let pending = Arc::new(AtomicUsize::new(0));
    while !control.is_stopped() {
        match listener.accept() {
            Ok((stream, peer)) => {
                if pending.load(Ordering::SeqCst) >= cfg.max_pending {
                    refuse_at_accept(stream, cfg);
                    log(
                        &cfg.name,
                        format_args!(
                            "refused {peer}: {} connections already in their hello",
                            cfg.max_pending
                        ),
                    );
                    continue;
                }
                pending.fetch_add(1, Ordering::SeqCst);
                let (tx, pending) = (tx.clone(), Arc::clone(&pending));
                scope.spawn(move || {
                    let admitted = hello(stream, cfg, control, gate);
                    pending.fetch_sub(1, Ordering::SeqCst);
                    if let Some(admitted) = admitted {
                        // The serving side is gone only after a stop; the session then just closes.
                        let _ = tx.send(admitted);
                    }
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => thread::sleep(ACCEPT_POLL),
            Err(e) => {
                log(&cfg.name, format_args!("accepting a connection: {e}"));
                thread::sleep(ACCEPT_POLL);
            }
        }
    }
}

/// Refuse a connection on the acceptor's own thread: one ERROR frame if the socket takes it at once
/// (it is small; nothing waits on a slow peer), then close.
fn refuse_at_accept(stream: TcpStream, cfg: &WorkerConfig) {
    use std::io::Write;
    let err = ErrorMsg::new(
        ErrorCode::Busy,
        &cfg.name,
        format!(
            "{} connections are already in their hello; try again shortly",
            cfg.max_pending
        ),
    );
    if let Ok(bytes) = encode(&Message::Error(err)) {
        if stream.set_nonblocking(true).is_ok() {
            let _ = (&stream).write(&bytes);
        }
    }
    let _ = stream.shutdown(Shutdown::Write);
}

/// The hello up to the gate: authenticate the peer, then admit its session or refuse it "busy".
fn hello(
    stream: TcpStream,
    cfg: &WorkerConfig,
    control: &WorkerControl,
    gate: &SessionGate,
) -> Option<Admitted> {
    let tracked = control.track(&stream);
    let setup = stream
        .set_nonblocking(false)
        .map_err(|e| QkError::Transport(e.to_string()));
    let mut conn = match setup.and_then(|()| Conn::from_stream(stream, cfg.timeouts)) {
        Ok(conn) => conn,
        Err(e) => {
            log(&cfg.name, format_args!("new connection: {e}"));
            return None;
        }
    };
    let server = ServerConfig {
        name: &cfg.name,
        secret: cfg.secret.as_deref(),
    };
    let handshake = match ServerHandshake::start(&mut conn, &server) {
        Ok(h) => h,
        Err(e) => {
            log(&cfg.name, format_args!("hello refused: {e}"));
            return None;
        }
    };
    match gate.begin(&cfg.name, handshake.hello()) {
        Ok(ticket) => Some(Admitted {
            conn,
            handshake,
            ticket,
            _tracked: tracked,
        }),
        Err(busy) => {
            log(&cfg.name, handshake.refuse(&mut conn, busy));
            None
        }
    }
}

/// The connection to the next stage, for the length of one head session.
struct Downstream {
    conn: Conn,
    _tracked: Tracked,
}

/// An error for the head, and whether the session must end after it is sent (the chain below is
/// gone or the peer broke the protocol); a stage's own failure leaves the session usable.
struct Failure {
    err: ErrorMsg,
    end: bool,
}

type Reply = std::result::Result<Message, Failure>;

/// Why a session's wait for its next request ended without one.
enum Waited {
    /// Another head took the session over: the ERROR that tells this head so.
    TakenOver(ErrorMsg),
    Failed(QkError),
}

/// How a session's connection is left: a last ERROR then a clean close, or just dropped (the peer
/// closed it, or it is dead).
enum Ending {
    Refuse(ErrorMsg),
    Drop,
}

struct Server<'a> {
    stage: &'a mut dyn Stage,
    own: &'a StageDesc,
    cfg: &'a WorkerConfig,
    control: &'a WorkerControl,
    down: Option<Downstream>,
}

impl Server<'_> {
    fn name(&self) -> &str {
        &self.own.name
    }

    fn keep(&self, code: ErrorCode, message: impl Into<String>) -> Failure {
        Failure {
            err: ErrorMsg::new(code, self.name(), message),
            end: false,
        }
    }

    fn end(&self, code: ErrorCode, message: impl Into<String>) -> Failure {
        Failure {
            err: ErrorMsg::new(code, self.name(), message),
            end: true,
        }
    }

    /// One head session: reset the stage, open the chain below, answer the hello, serve until the
    /// head closes, the connection fails or the session is taken over.
    fn session(&mut self, admitted: Admitted) {
        let Admitted {
            mut conn,
            handshake,
            ticket,
            _tracked: tracked,
        } = admitted;
        let head = handshake.hello().name.clone();
        // The previous session's hop, if it is still open, belongs to that session.
        self.close_downstream();
        if let Err(e) = self.stage.reset() {
            let err = ErrorMsg::new(
                ErrorCode::Stage,
                self.name(),
                format!("resetting for a new session: {e}"),
            );
            log(self.name(), handshake.refuse(&mut conn, err));
            return;
        }
        let mut chain = vec![self.own.clone()];
        if let Some(next) = self.cfg.next.clone() {
            match self.open_downstream(&next) {
                Ok(below) => chain.extend(below),
                Err(err) => {
                    log(self.name(), handshake.refuse(&mut conn, err));
                    return;
                }
            }
        }
        let stages = chain.len();
        if let Err(e) = handshake.finish(&mut conn, chain) {
            log(self.name(), format_args!("hello with '{head}' failed: {e}"));
            self.close_downstream();
            return;
        }
        log(
            self.name(),
            format_args!(
                "session from '{head}' ({}), {stages} stage(s) from here",
                conn.peer()
            ),
        );
        let ending = loop {
            let msg = match self.next_request(&mut conn, &ticket) {
                Ok(msg) => msg,
                Err(Waited::TakenOver(err)) => {
                    log(self.name(), format_args!("session from '{head}' {}", err.message));
                    break Ending::Refuse(err);
                }
                Err(Waited::Failed(e)) => {
                    let why = if self.control.is_stopped() {
                        "the worker is stopping".to_string()
                    } else {
                        e.to_string()
                    };
                    log(self.name(), format_args!("session from '{head}' closed: {why}"));
                    if e.to_string().contains(ErrorCode::BadFrame.describe()) {
                        break Ending::Refuse(ErrorMsg::new(ErrorCode::BadFrame, self.name(), e.to_string()));
                    }
                    break Ending::Drop;
                }
            };
            if matches!(msg, Message::Close) {
                log(
                    self.name(),
                    format_args!("session from '{head}' closed by the head"),
                );
                break Ending::Drop;
            }
            match self.handle(msg) {
                Ok(reply) => {
                    if let Err(e) = conn.send(&reply) {
                        log(self.name(), format_args!("session from '{head}' closed: {e}"));
                        break Ending::Drop;
                    }
                }
                Err(failure) if failure.end => {
                    log(
                        self.name(),
                        format_args!("session from '{head}' ended after an error: {}", failure.err),
                    );
                    break Ending::Refuse(failure.err);
                }
                Err(failure) => {
                    if let Err(e) = conn.send(&Message::Error(failure.err)) {
                        log(self.name(), format_args!("session from '{head}' closed: {e}"));
                        break Ending::Drop;
                    }
                }
            }
        };
        // Free the gate before the (possibly slow) closing, so the next head is not told "busy".
        drop(ticket);
        self.close_downstream();
        if let Ending::Refuse(err) = ending {
            // The refusal waits (boundedly) for the peer to close; a peer that never does must not
            // hold up the next session, so it waits on a thread of its own (still stoppable).
            thread::spawn(move || {
                conn.refuse(&err);
                drop(tracked);
            });
        }
    }

    /// The session's next request, waited for in slices so that a takeover (answered with its
    /// ERROR) or a stop ends an idle session within `SESSION_POLL`. A takeover is noticed before a
    /// request that came with it is served: the old head gets the ERROR as that request's reply.
    fn next_request(&self, conn: &mut Conn, ticket: &SessionTicket) -> std::result::Result<Message, Waited> {
        // Polled first: in a decode the next request comes within a step.
        let mut ready = conn.spin_until_readable(conn.timeouts().spin);
        loop {
            if !ready {
                ready = conn.readable_within(SESSION_POLL).map_err(Waited::Failed)?;
            }
            if let Some(takeover) = ticket.taken_over() {
                return Err(Waited::TakenOver(takeover.error(self.name())));
            }
            if self.control.is_stopped() {
                return Err(Waited::Failed(QkError::Transport(
                    "the worker is stopping".into(),
                )));
            }
            if ready {
                return conn.recv_ready().map_err(Waited::Failed);
            }
        }
    }

    fn close_downstream(&mut self) {
        if let Some(mut down) = self.down.take() {
            down.conn.close();
        }
    }

    /// Connect and hello the next stage, checking the chain below against this stage; returns the
    /// chain from the next stage on, or the error to refuse the head with (a downstream refusal is
    /// relayed intact, so it names the stage that refused).
    fn open_downstream(&mut self, next: &str) -> std::result::Result<Vec<StageDesc>, ErrorMsg> {
        let unavailable = |e: QkError| {
            ErrorMsg::new(
                ErrorCode::Unavailable,
                &self.own.name,
                format!("next stage {next}: {e}"),
            )
        };
        let stream = connect_stream(next, self.cfg.timeouts.connect).map_err(unavailable)?;
        let tracked = self.control.track(&stream);
        let mut conn = Conn::from_stream(stream, self.cfg.timeouts).map_err(unavailable)?;
        let client = ClientConfig {
            name: &self.own.name,
            secret: self.cfg.secret.as_deref(),
            takeover: self.cfg.takeover_next,
            own: Some(self.own),
        };
        match conn.client_hello(&client) {
            Ok(below) => {
                self.down = Some(Downstream {
                    conn,
                    _tracked: tracked,
                });
                Ok(below)
            }
            Err(e) => Err(match conn.peer_error() {
                Some(theirs) => theirs.clone(),
                None => {
                    let text = e.to_string();
                    // Our own refusal of the next stage (its chain, its proof) keeps its code.
                    let code = [ErrorCode::Chain, ErrorCode::Auth, ErrorCode::Version]
                        .into_iter()
                        .find(|c| text.contains(c.describe()))
                        .unwrap_or(ErrorCode::Unavailable);
                    ErrorMsg::new(code, &self.own.name, format!("next stage {next}: {text}"))
                }
            }),
        }
    }

    fn handle(&mut self, msg: Message) -> Reply {
        match msg {
            Message::Run(run) => self.run(run),
            Message::Step(step) => self.step(step),
            Message::Save { slot, idx } => {
                let done = self.stage.save(slot, idx);
                self.snapshot_op(Op::Save, slot, idx, done, Message::Save { slot, idx })
            }
            Message::Load { slot, idx } => {
                let done = self.stage.load(slot, idx);
                self.snapshot_op(Op::Load, slot, idx, done, Message::Load { slot, idx })
            }
            Message::Drop { idx } => {
                let done = self.stage.drop_snapshot(idx);
                self.snapshot_op(Op::Drop, 0, idx, done, Message::Drop { idx })
            }
            Message::Ping { seq } => {
                // The chain answers as one: a pong means every stage below is alive too.
                if self.down.is_some() {
                    match self.forward(&Message::Ping { seq })? {
                        Message::Pong { seq: echoed } if echoed == seq => {}
                        other => return Err(self.unexpected("ping", &other)),
                    }
                }
                Ok(Message::Pong { seq })
            }
            other => Err(self.end(
                ErrorCode::BadFrame,
                format!(
                    "{} is not a request a head may send in a session",
                    other.op().name()
                ),
            )),
        }
    }

    fn unexpected(&self, what: &str, got: &Message) -> Failure {
        self.end(
            ErrorCode::BadFrame,
            format!("the next stage answered a {what} with {}", got.op().name()),
        )
    }

    /// Send `msg` down the chain and return the answer. A stage failure below is relayed and the
    /// session goes on; any other failure ends it (the head reconnects, which re-checks the chain).
    fn forward(&mut self, msg: &Message) -> Reply {
        let Some(down) = self.down.as_mut() else {
            return Err(Failure {
                err: ErrorMsg::new(
                    ErrorCode::Unavailable,
                    &self.own.name,
                    "no connection to the next stage",
                ),
                end: true,
            });
        };
        match down.conn.request(msg) {
            Ok(reply) => Ok(reply),
            Err(e) => {
                let failure = match down.conn.peer_error() {
                    Some(theirs) => Failure {
                        err: theirs.clone(),
                        end: theirs.code != ErrorCode::Stage,
                    },
                    None => Failure {
                        err: ErrorMsg::new(
                            ErrorCode::Unavailable,
                            &self.own.name,
                            format!("the next stage failed: {e}"),
                        ),
                        end: true,
                    },
                };
                if failure.end {
                    self.close_downstream();
                }
                Err(failure)
            }
        }
    }

    /// Hidden rows must be exactly this model's width (the reader already refused wider ones).
    fn check_input(&self, rows: &Rows) -> std::result::Result<(), Failure> {
        if let Rows::Hidden(h) = rows {
            if h.width != self.own.n_embd {
                return Err(self.keep(
                    ErrorCode::Stage,
                    format!(
                        "hidden rows of width {}, this model's n_embd is {}",
                        h.width, self.own.n_embd
                    ),
                ));
            }
        }
        Ok(())
    }

    fn stage_failed(&self, e: QkError) -> Failure {
        self.keep(ErrorCode::Stage, e.to_string())
    }

    fn run(&mut self, run: Run) -> Reply {
        self.check_input(&run.rows)?;
        let n = match &run.rows {
            Rows::Tokens(ids) => ids.len(),
            Rows::Hidden(h) => h.data.len() / h.width.max(1) as usize,
        };
        let out = self
            .stage
            .run(run.slot, run.base, &run.rows, run.topk)
            .map_err(|e| self.stage_failed(e))?;
        match (out, self.down.is_some()) {
            (RunOut::Ids { ids, topk }, false) => {
                if ids.len() != n || topk.len() > run.topk as usize {
                    return Err(self.keep(
                        ErrorCode::Stage,
                        format!(
                            "the stage answered {} ids and {} top-k pairs for {n} rows and top-k {}",
                            ids.len(),
                            topk.len(),
                            run.topk
                        ),
                    ));
                }
                Ok(Message::RunReply(RunReply {
                    slot: run.slot,
                    base: run.base,
                    out: RunOut::Ids { ids, topk },
                }))
            }
            (RunOut::Hidden(hidden), true) => {
                if hidden.width != self.own.n_embd || hidden.data.len() != n * hidden.width as usize {
                    return Err(self.keep(
                        ErrorCode::Stage,
                        format!(
                            "the stage answered {} floats of width {} for {n} rows of n_embd {}",
                            hidden.data.len(),
                            hidden.width,
                            self.own.n_embd
                        ),
                    ));
                }
                let forwarded = Message::Run(Run {
                    slot: run.slot,
                    base: run.base,
                    topk: run.topk,
                    rows: Rows::Hidden(hidden),
                });
                match self.forward(&forwarded)? {
                    Message::RunReply(reply)
                        if reply.slot == run.slot
                            && reply.base == run.base
                            && matches!(reply.out, RunOut::Ids { .. }) =>
                    {
                        Ok(Message::RunReply(reply))
                    }
                    other => Err(self.unexpected("run", &other)),
                }
            }
            (RunOut::Ids { .. }, true) => Err(self.keep(
                ErrorCode::Stage,
                "the stage answered ids but does not end the model",
            )),
            (RunOut::Hidden(_), false) => Err(self.keep(
                ErrorCode::Stage,
                "the stage answered hidden rows but ends the model",
            )),
        }
    }

    fn step(&mut self, step: Step) -> Reply {
        self.check_input(&step.rows)?;
        let n = step.entries.len();
        let out = self
            .stage
            .step(&step.entries, &step.rows, step.topk)
            .map_err(|e| self.stage_failed(e))?;
        match (out, self.down.is_some()) {
            (StepOut::Ids { ids, topk }, false) => {
                let k = topk.first().map_or(0, Vec::len);
                if ids.len() != n
                    || topk.len() != n
                    || topk.iter().any(|t| t.len() != k)
                    || k > step.topk as usize
                {
                    return Err(self.keep(
                        ErrorCode::Stage,
                        format!(
                            "the stage answered {} ids and {} top-k lists for {n} entries and top-k {}",
                            ids.len(),
                            topk.len(),
                            step.topk
                        ),
                    ));
                }
                Ok(Message::StepReply(StepReply {
                    entries: step.entries,
                    out: StepOut::Ids { ids, topk },
                }))
            }
            (StepOut::Hidden(hidden), true) => {
                if hidden.width != self.own.n_embd || hidden.data.len() != n * hidden.width as usize {
                    return Err(self.keep(
                        ErrorCode::Stage,
                        format!(
                            "the stage answered {} floats of width {} for {n} entries of n_embd {}",
                            hidden.data.len(),
                            hidden.width,
                            self.own.n_embd
                        ),
                    ));
                }
                let forwarded = Message::Step(Step {
                    topk: step.topk,
                    entries: step.entries.clone(),
                    rows: Rows::Hidden(hidden),
                });
                match self.forward(&forwarded)? {
                    Message::StepReply(reply)
                        if reply.entries == step.entries && matches!(reply.out, StepOut::Ids { .. }) =>
                    {
                        Ok(Message::StepReply(reply))
                    }
                    other => Err(self.unexpected("step", &other)),
                }
            }
            (StepOut::Ids { .. }, true) => Err(self.keep(
                ErrorCode::Stage,
                "the stage answered ids but does not end the model",
            )),
            (StepOut::Hidden(_), false) => Err(self.keep(
                ErrorCode::Stage,
                "the stage answered hidden rows but ends the model",
            )),
        }
    }

    /// SAVE / LOAD / DROP: done here (`done`), then on the chain below; acknowledged once all did it.
    fn snapshot_op(&mut self, of: Op, slot: u32, idx: u32, done: Result<()>, request: Message) -> Reply {
        done.map_err(|e| self.stage_failed(e))?;
        if self.down.is_some() {
            match self.forward(&request)? {
                Message::Ack(ack) if ack.of == of && ack.slot == slot && ack.idx == idx => {}
                other => return Err(self.unexpected(of.name(), &other)),
            }
        }
        Ok(Message::Ack(Ack { of, slot, idx }))
    }
}

/// A TCP connection to `addr` (host:port), each resolved address tried within `timeout`.
pub fn connect_stream(addr: &str, timeout: Duration) -> Result<TcpStream> {
    let fail = |why: String| QkError::Transport(format!("{addr}: cannot connect: {why}"));
    let addrs: Vec<SocketAddr> = addr.to_socket_addrs().map_err(|e| fail(e.to_string()))?.collect();
    let mut last = String::from("the name resolved to no address");
    for a in addrs {
        match TcpStream::connect_timeout(&a, timeout) {
            Ok(stream) => return Ok(stream),
            Err(e) => last = format!("{a}: {e}"),
        }
    }
    Err(fail(last))
}
