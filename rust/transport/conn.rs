//! The blocking qkp connection: connect (with a timeout) or accept, TCP_NODELAY and keepalive set at
//! once, whole messages written and read under deadlines that scale with their rows, both sides of
//! the hello, and a worker's one-head-session gate. A bad frame or a timeout is a
//! `QkError::Transport` naming the peer and the reason; it ends that connection only.
//!
//! A worker: `Conn::accept` → `ServerHandshake::start` (version, nonces, the client's proof, all
//! within `Timeouts::pre_auth`, reading nothing but hello-sized frames) → `SessionGate::begin`
//! (busy / takeover) → its own downstream `Conn::connect` + `client_hello` →
//! `ServerHandshake::finish` with its description plus the downstream chain → loop on
//! `readable_within` (watching its `SessionTicket` for a takeover), `recv` and `send`. A head:
//! `Conn::connect` → `client_hello` (checks the chain) → `request` per RUN/STEP.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use socket2::{SockRef, TcpKeepalive};

use crate::error::{QkError, Result};
use crate::transport::auth::{self, Role};
use crate::transport::frame::{self, ErrorCode, HEADER_LEN, Limits, MAX_WIDTH, Op, VERSION};
use crate::transport::hello::{Challenge, ClientHello, HelloReply, Proof, StageDesc, check_chain};
use crate::transport::messages::{ErrorMsg, Message, decode_payload, encode};

/// Keepalive probes: a peer that vanished without a FIN (power loss, cable) is noticed within about
/// time + retries × interval = 30 s even while a worker waits indefinitely for the next request.
const KEEPALIVE_TIME: Duration = Duration::from_secs(15);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
const KEEPALIVE_RETRIES: u32 = 3;
/// After refusing a peer, how long and how much of its unread input we drain before closing, so the
/// close is a FIN rather than a reset that could destroy the ERROR frame we just sent.
const DRAIN_TIME: Duration = Duration::from_secs(2);
const DRAIN_BYTES: usize = 1 << 20;

/// Time limits of a connection. A message carrying n rows must be written or read completely within
/// `base + n × per_row`; a request's reply must arrive within the same bound counted from the send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    pub connect: Duration,
    /// Each hello step (a worker's reply includes its own downstream connect and hello).
    pub hello: Duration,
    /// A worker's whole wait for an unauthenticated peer's hello and proof, from accept: a peer
    /// that has not proved the secret holds a connection (and a thread) no longer than this.
    pub pre_auth: Duration,
    pub base: Duration,
    pub per_row: Duration,
    /// How long a wait for the peer's next message first polls the socket without sleeping: a
    /// thread asleep for the milliseconds of a decode step wakes late (its core idled), which a
    /// split pays twice per token. Zero by default; a stage on a GPU takes its engine's
    /// `spin_wait` (a CPU adapter's threads need the cores).
    pub spin: Duration,
}

impl Default for Timeouts {
    fn default() -> Timeouts {
        // per_row: a prefill row through a slow stage (tens of ms on a software Vulkan device) fits.
        Timeouts {
            connect: Duration::from_secs(5),
            hello: Duration::from_secs(30),
            pre_auth: Duration::from_secs(5),
            base: Duration::from_secs(30),
            per_row: Duration::from_millis(20),
            spin: Duration::ZERO,
        }
    }
}

impl Timeouts {
    pub fn for_rows(&self, n: u32) -> Duration {
        self.base.saturating_add(self.per_row.saturating_mul(n))
    }
}

/// The client side of a hello.
#[derive(Clone, Copy, Debug)]
pub struct ClientConfig<'a> {
    /// Who is connecting (the head's or upstream stage's name), shown in the worker's messages.
    pub name: &'a str,
    pub secret: Option<&'a [u8]>,
    /// Replace a live head session instead of being refused as busy.
    pub takeover: bool,
    /// This side's own stage: when given, the returned chain is checked against it (`check_chain`).
    pub own: Option<&'a StageDesc>,
}

/// The worker side of a hello.
#[derive(Clone, Copy, Debug)]
pub struct ServerConfig<'a> {
    /// This stage's name, put on every ERROR it sends.
    pub name: &'a str,
    pub secret: Option<&'a [u8]>,
}

fn check_secret(secret: Option<&[u8]>) -> Result<()> {
    if secret.is_some_and(<[u8]>::is_empty) {
        return Err(QkError::Transport("the shared secret is empty".into()));
    }
    Ok(())
}

pub struct Conn {
    stream: TcpStream,
    peer: String,
    timeouts: Timeouts,
    limits: Limits,
    peer_error: Option<ErrorMsg>,
    /// The socket's SO_RCVTIMEO and SO_SNDTIMEO as last set (outer None: not known), so a read or
    /// write sets them only when the deadline needs it: one setsockopt per read was a third of a
    /// decode step's syscalls on the link (`benches/link.rs`).
    read_timeout: Option<Option<Duration>>,
    write_timeout: Option<Option<Duration>>,
}

/// Bound a blocking socket call to `left` (None: no limit) through `apply` (a setsockopt), unless
/// the timeout last set (`cached`) already does well enough: never longer than what is left, and
/// not so much shorter that a long wait wakes often.
fn fit_timeout(
    cached: &mut Option<Option<Duration>>,
    left: Option<Duration>,
    apply: impl FnOnce(Option<Duration>) -> io::Result<()>,
) -> io::Result<()> {
    let fits = match (*cached, left) {
        (Some(Some(set)), Some(left)) => set <= left && set >= left / 2,
        (Some(None), None) => true,
        _ => false,
    };
    if !fits {
        *cached = None;
        apply(left)?;
        *cached = Some(left);
    }
    Ok(())
}

impl Conn {
    /// Connect to `addr` (host:port; each resolved address tried within `timeouts.connect`).
    pub fn connect(addr: &str, timeouts: Timeouts) -> Result<Conn> {
        let fail = |why: String| QkError::Transport(format!("{addr}: cannot connect: {why}"));
        let addrs: Vec<SocketAddr> = addr.to_socket_addrs().map_err(|e| fail(e.to_string()))?.collect();
        let mut last = String::from("the name resolved to no address");
        for a in addrs {
            match TcpStream::connect_timeout(&a, timeouts.connect) {
                Ok(stream) => return Conn::from_stream(stream, timeouts),
                Err(e) => last = format!("{a}: {e}"),
            }
        }
        Err(fail(last))
    }

    /// Accept the next connection on `listener`.
    pub fn accept(listener: &TcpListener, timeouts: Timeouts) -> Result<Conn> {
        let (stream, _) = listener
            .accept()
            .map_err(|e| QkError::Transport(format!("accepting a connection: {e}")))?;
        Conn::from_stream(stream, timeouts)
    }

    /// Wrap a connected stream: TCP_NODELAY (one small frame per decode step must not wait for
    /// Nagle) and keepalive on.
    pub fn from_stream(stream: TcpStream, timeouts: Timeouts) -> Result<Conn> {
        let peer = stream
            .peer_addr()
            .map_or_else(|_| "unknown peer".to_string(), |a| a.to_string());
        let fail = |what: &str, e: io::Error| QkError::Transport(format!("{peer}: setting {what}: {e}"));
        stream.set_nodelay(true).map_err(|e| fail("TCP_NODELAY", e))?;
        let keepalive = TcpKeepalive::new()
            .with_time(KEEPALIVE_TIME)
            .with_interval(KEEPALIVE_INTERVAL);
        #[cfg(any(target_os = "linux", target_os = "macos", target_os = "windows"))]
        let keepalive = keepalive.with_retries(KEEPALIVE_RETRIES);
        SockRef::from(&stream)
            .set_tcp_keepalive(&keepalive)
            .map_err(|e| fail("keepalive", e))?;
        Ok(Conn {
            stream,
            peer,
            timeouts,
            limits: Limits::default(),
            peer_error: None,
            read_timeout: None,
            write_timeout: None,
        })
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }

    pub fn timeouts(&self) -> Timeouts {
        self.timeouts
    }

    pub fn set_timeouts(&mut self, timeouts: Timeouts) {
        self.timeouts = timeouts;
    }

    /// Tighten the reader's caps (the hello sets the row width to the chain's n_embd).
    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Whether TCP_NODELAY and keepalive are on (they are set at connect/accept).
    pub fn nodelay(&self) -> Result<bool> {
        self.stream
            .nodelay()
            .map_err(|e| self.fail(format!("reading TCP_NODELAY: {e}")))
    }

    pub fn keepalive(&self) -> Result<bool> {
        SockRef::from(&self.stream)
            .keepalive()
            .map_err(|e| self.fail(format!("reading keepalive: {e}")))
    }

    /// The ERROR the peer sent in answer to the last hello or request, if that is how it failed: a
    /// worker relays it upstream intact, so the head sees the failing stage's own name.
    pub fn peer_error(&self) -> Option<&ErrorMsg> {
        self.peer_error.as_ref()
    }

    fn fail(&self, why: String) -> QkError {
        QkError::Transport(format!("{}: {why}", self.peer))
    }

    /// Write one message within `timeouts.for_rows(rows)`.
    pub fn send(&mut self, msg: &Message) -> Result<()> {
        let bytes = encode(msg)?;
        let deadline = Instant::now() + self.timeouts.for_rows(msg.rows());
        let mut sent = 0;
        while sent < bytes.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(self.fail(format!(
                    "timed out writing {} ({sent} of {} bytes)",
                    msg.op().name(),
                    bytes.len()
                )));
            }
            fit_timeout(&mut self.write_timeout, Some(left), |t| {
                self.stream.set_write_timeout(t)
            })
            .map_err(|e| self.fail(format!("set write timeout: {e}")))?;
            match self.stream.write(&bytes[sent..]) {
                Ok(0) => return Err(self.fail("the connection closed while writing".into())),
                Ok(k) => sent += k,
                // A timeout shorter than what is left: the loop checks the deadline again.
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => return Err(self.fail(format!("writing {}: {e}", msg.op().name()))),
            }
        }
        Ok(())
    }

    /// Make the socket's blocking reads return within `left` (None: wait as long as it takes),
    /// setting SO_RCVTIMEO only where the one set does not fit.
    fn bound_reads(&mut self, left: Option<Duration>) -> Result<()> {
        fit_timeout(&mut self.read_timeout, left, |t| self.stream.set_read_timeout(t))
            .map_err(|e| self.fail(format!("set read timeout: {e}")))
    }

    /// Fill `buf` before `deadline` (None: wait forever).
    fn read_by(&mut self, buf: &mut [u8], deadline: Option<Instant>, what: &str) -> Result<()> {
        let mut got = 0;
        while got < buf.len() {
            let timeout = match deadline {
                None => None,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(self.fail(format!("timed out {what} ({got} of {} bytes)", buf.len())));
                    }
                    Some(left)
                }
            };
            self.bound_reads(timeout)?;
            match self.stream.read(&mut buf[got..]) {
                Ok(0) => {
                    return Err(self.fail(format!(
                        "the connection closed {what} ({got} of {} bytes)",
                        buf.len()
                    )));
                }
                Ok(k) => got += k,
                // A timeout shorter than what is left: the loop checks the deadline again.
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => return Err(self.fail(format!("{what}: {e}"))),
            }
        }
        Ok(())
    }

    /// Read a header's bytes: the first byte may take `wait` (None: forever — a worker idles between
    /// requests), the rest must follow within `timeouts.base`. A timed wait (a reply's) first polls
    /// for up to `timeouts.spin`, within the same deadline; a worker polls for its next request
    /// before it reads (`next_request`).
    fn read_header_bytes(&mut self, wait: Option<Duration>) -> Result<[u8; HEADER_LEN]> {
        let deadline = wait.map(|w| Instant::now() + w);
        if let Some(w) = wait
            && self.spin_until_readable(self.timeouts.spin.min(w))
        {
            return self.header_now();
        }
        let mut head = [0u8; HEADER_LEN];
        self.read_by(&mut head[..1], deadline, "waiting for a message")?;
        let deadline = Instant::now() + self.timeouts.base;
        self.read_by(&mut head[1..], Some(deadline), "reading a frame header")?;
        Ok(head)
    }

    /// A header that has begun to arrive: all of it within `timeouts.base`, in one read as a rule.
    fn header_now(&mut self) -> Result<[u8; HEADER_LEN]> {
        let mut head = [0u8; HEADER_LEN];
        let deadline = Instant::now() + self.timeouts.base;
        self.read_by(&mut head, Some(deadline), "waiting for a message")?;
        Ok(head)
    }

    /// Read one message that has begun to arrive (`spin_until_readable` or `readable_within` saw
    /// it): as `recv`, without a first read for its first byte alone.
    pub fn recv_ready(&mut self) -> Result<Message> {
        let head = self.header_now()?;
        self.read_rest(&head)
    }

    /// Check the header, then read and decode the payload within `timeouts.for_rows(n)`. The payload
    /// buffer is allocated only after every bound in the header has been checked.
    fn read_rest(&mut self, head: &[u8; HEADER_LEN]) -> Result<Message> {
        let h = frame::decode_header(head, &self.limits).map_err(|e| self.fail(e.to_string()))?;
        self.read_payload(&h, Instant::now() + self.timeouts.for_rows(h.n))
    }

    /// The payload of checked header `h`, read by `deadline` and decoded.
    fn read_payload(&mut self, h: &frame::Header, deadline: Instant) -> Result<Message> {
        let mut payload = vec![0u8; h.len as usize];
        self.read_by(
            &mut payload,
            Some(deadline),
            &format!("reading a {} payload", h.op.name()),
        )?;
        decode_payload(h, &payload).map_err(|e| self.fail(e.to_string()))
    }

    /// Read one message. The first byte may take `wait` (None: forever); once it has come, the frame
    /// must be complete within `timeouts.for_rows(n)`. An ERROR from the peer is returned as a message.
    pub fn recv(&mut self, wait: Option<Duration>) -> Result<Message> {
        let head = self.read_header_bytes(wait)?;
        self.read_rest(&head)
    }

    /// Read one frame of the hello before the peer has proved anything: the whole frame by
    /// `deadline`, and it must be `want` (or the peer's ERROR) — anything else is refused from its
    /// header alone, so an unauthenticated peer never gets more than a hello-sized payload read
    /// (the header check caps HELLO, PROOF and ERROR payloads at a few hundred bytes).
    fn recv_pre_auth(&mut self, want: Op, deadline: Instant) -> Result<Message> {
        let mut head = [0u8; HEADER_LEN];
        self.read_by(&mut head, Some(deadline), "waiting for the hello")?;
        self.decode_pre_auth(&head, want, deadline)
    }

    fn decode_pre_auth(&mut self, head: &[u8; HEADER_LEN], want: Op, deadline: Instant) -> Result<Message> {
        let h = frame::decode_header(head, &self.limits).map_err(|e| self.fail(e.to_string()))?;
        if h.op != want && h.op != Op::Error {
            return Err(self.fail(format!(
                "{}: expected a {} before authentication, got a {} header (its payload is not read)",
                ErrorCode::BadFrame.describe(),
                want.name(),
                h.op.name()
            )));
        }
        self.read_payload(&h, deadline)
    }

    /// Poll the socket without sleeping until a byte (or the peer's close, or an error, which the
    /// read after reports) is waiting, for at most `spin`; whether one is.
    pub fn spin_until_readable(&mut self, spin: Duration) -> bool {
        if spin.is_zero() || self.stream.set_nonblocking(true).is_err() {
            return false;
        }
        // A spin too long for the clock polls until something comes.
        let deadline = Instant::now().checked_add(spin);
        let mut byte = [0u8; 1];
        let ready = loop {
            match self.stream.peek(&mut byte) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                _ => break true,
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                break false;
            }
            std::hint::spin_loop();
        };
        // A socket left non-blocking would turn the timed reads after into instant failures.
        if self.stream.set_nonblocking(false).is_err() {
            return false;
        }
        ready
    }

    /// Whether a message (or the peer's close) is waiting, after waiting at most `timeout` (at
    /// least a millisecond). A worker waits for a session's next request in such slices, so it
    /// notices a takeover or a stop between them; a head looks between calls for what the chain
    /// sent unasked (a takeover notice).
    pub fn readable_within(&mut self, timeout: Duration) -> Result<bool> {
        self.bound_reads(Some(timeout.max(Duration::from_millis(1))))?;
        let mut byte = [0u8; 1];
        match self.stream.peek(&mut byte) {
            // Ok(0) is the peer's close: the next read reports it.
            Ok(_) => Ok(true),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
                ) =>
            {
                Ok(false)
            }
            Err(e) => Err(self.fail(format!("waiting for a message: {e}"))),
        }
    }

    /// Send a request and read its reply (within `timeouts.for_rows(rows)` of the send, which
    /// includes the chain's compute). An ERROR reply becomes `Err` and is kept for `peer_error`.
    pub fn request(&mut self, msg: &Message) -> Result<Message> {
        self.peer_error = None;
        self.send(msg)?;
        let reply = self.recv(Some(self.timeouts.for_rows(msg.rows())))?;
        self.reject_error(reply)
    }

    fn reject_error(&mut self, reply: Message) -> Result<Message> {
        if let Message::Error(e) = reply {
            let err = self.fail(e.to_string());
            self.peer_error = Some(e);
            return Err(err);
        }
        Ok(reply)
    }

    /// Round-trip time of a PING.
    pub fn ping(&mut self, seq: u32) -> Result<Duration> {
        let start = Instant::now();
        match self.request(&Message::Ping { seq })? {
            Message::Pong { seq: echoed } if echoed == seq => Ok(start.elapsed()),
            other => Err(self.fail(format!("expected pong {seq}, got {}", describe(&other)))),
        }
    }

    /// Tell the peer why it is being refused (best effort) and close; then return nothing: the
    /// caller already has its own error to log or return.
    pub fn refuse(&mut self, err: &ErrorMsg) {
        let _ = self.send(&Message::Error(err.clone()));
        self.drain_close();
    }

    /// End the session cleanly: CLOSE (best effort), then close.
    pub fn close(&mut self) {
        let _ = self.send(&Message::Close);
        self.drain_close();
    }

    /// Shut our side, then read (and drop) what the peer still sends until it closes, for at most
    /// DRAIN_TIME / DRAIN_BYTES: unread input would make the close a reset.
    fn drain_close(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Write);
        self.read_timeout = None;
        let deadline = Instant::now() + DRAIN_TIME;
        let mut scratch = [0u8; 4096];
        let mut drained = 0;
        while drained < DRAIN_BYTES {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || self.stream.set_read_timeout(Some(left)).is_err() {
                break;
            }
            match self.stream.read(&mut scratch) {
                Ok(0) | Err(_) => break,
                Ok(k) => drained += k,
            }
        }
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    /// Refuse the peer with `code` and return the local error with the same words.
    fn refuse_with(&mut self, code: ErrorCode, stage: &str, message: String) -> QkError {
        let err = ErrorMsg::new(code, stage, message);
        self.refuse(&err);
        self.fail(format!("{}: {}", code.describe(), err.message))
    }

    /// Expect `want` from the peer during the hello; an ERROR is the peer's refusal.
    fn expect_hello_step(&mut self, want: Op) -> Result<Message> {
        let msg = self.recv(Some(self.timeouts.hello))?;
        let msg = self.reject_error(msg)?;
        if msg.op() != want {
            let got = describe(&msg);
            return Err(self.fail(format!("expected {} during the hello, got {got}", want.name())));
        }
        Ok(msg)
    }

    /// The client side of the hello (docs/protocol.md "Hello"): send a hello with a fresh nonce, answer the worker's
    /// challenge with a proof, verify the worker's proof, and check the chain against `cfg.own`.
    /// Returns the chain: the worker's description first, then every stage after it.
    pub fn client_hello(&mut self, cfg: &ClientConfig) -> Result<Vec<StageDesc>> {
        self.peer_error = None;
        check_secret(cfg.secret)?;
        let hello = ClientHello {
            nonce: auth::nonce()?,
            name: cfg.name.to_string(),
            takeover: cfg.takeover,
            has_secret: cfg.secret.is_some(),
        };
        self.send(&Message::Hello(hello.clone()))?;
        let Message::Challenge(challenge) = self.expect_hello_step(Op::Challenge)? else {
            return Err(self.fail("expected a challenge".into()));
        };
        let proof = match (cfg.secret, challenge.has_secret) {
            (Some(secret), true) => Some(auth::prove(
                secret,
                Role::Client,
                &auth::client_transcript(&hello, &challenge)?,
            )?),
            (None, false) => None,
            (Some(_), false) => {
                let why = "a shared secret is configured here but not on the worker".to_string();
                return Err(self.refuse_with(ErrorCode::Auth, cfg.name, why));
            }
            (None, true) => {
                let why = "the worker requires a shared secret and none is configured here".to_string();
                return Err(self.refuse_with(ErrorCode::Auth, cfg.name, why));
            }
        };
        self.send(&Message::Proof(Proof { proof }))?;
        let Message::HelloReply(reply) = self.expect_hello_step(Op::HelloReply)? else {
            return Err(self.fail("expected a hello reply".into()));
        };
        if let Some(secret) = cfg.secret {
            let transcript = auth::worker_transcript(&hello, &challenge, &reply.chain)?;
            let valid = match &reply.proof {
                Some(p) => auth::verify(secret, Role::Worker, &transcript, p)?,
                None => false,
            };
            if !valid {
                let why = match reply.proof {
                    Some(_) => "the worker's proof does not match the shared secret",
                    None => "the worker sent no proof",
                };
                return Err(self.refuse_with(ErrorCode::Auth, cfg.name, why.to_string()));
            }
        } else if reply.proof.is_some() {
            let why = "the worker sent a proof but no shared secret is configured here".to_string();
            return Err(self.refuse_with(ErrorCode::Auth, cfg.name, why));
        }
        if let Some(own) = cfg.own {
            if let Err(e) = check_chain(own, &reply.chain) {
                let text = e.to_string();
                let detail = text.strip_prefix("chain refused: ").unwrap_or(&text).to_string();
                return Err(self.refuse_with(ErrorCode::Chain, cfg.name, detail));
            }
        }
        self.limit_width(&reply.chain);
        Ok(reply.chain)
    }

    /// Hidden rows on this connection are exactly n_embd wide: refuse wider ones before allocating.
    fn limit_width(&mut self, chain: &[StageDesc]) {
        if let Some(first) = chain.first() {
            if first.n_embd > 0 && first.n_embd <= MAX_WIDTH {
                self.limits.max_width = first.n_embd;
            }
        }
    }
}

/// A one-line description of a message for "expected X, got Y" errors.
fn describe(msg: &Message) -> String {
    match msg {
        Message::Error(e) => format!("error ({e})"),
        other => other.op().name().to_string(),
    }
}

/// The worker side of a hello, between the client's proof and the worker's reply: the worker checks
/// its session gate and connects downstream in between (so neither happens for an unauthenticated
/// peer), then `finish`es with the chain or `refuse`s.
pub struct ServerHandshake {
    hello: ClientHello,
    challenge: Challenge,
    secret: Option<Vec<u8>>,
    name: String,
}

impl ServerHandshake {
    /// Read the hello (a foreign version is answered with an ERROR naming both versions), send a
    /// challenge, and check the client's proof ("authentication failed" to both ends if it is
    /// missing, wrong, or unexpected). Everything before the proof is checked must arrive within
    /// `timeouts.pre_auth` and be hello-sized: any other frame is refused from its header.
    pub fn start(conn: &mut Conn, cfg: &ServerConfig) -> Result<ServerHandshake> {
        check_secret(cfg.secret)?;
        let deadline = Instant::now() + conn.timeouts.pre_auth;
        let mut head = [0u8; HEADER_LEN];
        conn.read_by(&mut head, Some(deadline), "waiting for the hello")?;
        if let Some(theirs) = frame::foreign_version(&head) {
            let why = format!("the peer speaks version {theirs}, this worker speaks version {VERSION}");
            return Err(conn.refuse_with(ErrorCode::Version, cfg.name, why));
        }
        let hello = match conn.decode_pre_auth(&head, Op::Hello, deadline) {
            Ok(Message::Hello(hello)) => hello,
            Ok(other) => {
                let why = format!("expected a hello, got {}", describe(&other));
                return Err(conn.refuse_with(ErrorCode::BadFrame, cfg.name, why));
            }
            Err(e) => {
                conn.refuse(&ErrorMsg::new(ErrorCode::BadFrame, cfg.name, e.to_string()));
                return Err(e);
            }
        };
        let challenge = Challenge {
            nonce: auth::nonce()?,
            has_secret: cfg.secret.is_some(),
        };
        conn.send(&Message::Challenge(challenge.clone()))?;
        let proof = match conn.recv_pre_auth(Op::Proof, deadline) {
            Ok(Message::Proof(proof)) => proof,
            // Only the client's ERROR gets here (decode_pre_auth refuses any other op).
            Ok(other) => {
                let refused = conn.reject_error(other).err();
                return Err(refused.unwrap_or_else(|| conn.fail("expected a proof".into())));
            }
            Err(e) => {
                conn.refuse(&ErrorMsg::new(ErrorCode::BadFrame, cfg.name, e.to_string()));
                return Err(e);
            }
        };
        let from = format!("head '{}'", hello.name);
        let refusal = match (cfg.secret, proof.proof) {
            (Some(secret), Some(p)) => {
                let transcript = auth::client_transcript(&hello, &challenge)?;
                (!auth::verify(secret, Role::Client, &transcript, &p)?)
                    .then(|| format!("the proof from {from} does not match the shared secret"))
            }
            (Some(_), None) => Some(format!(
                "{from} sent no proof; this worker requires the shared secret"
            )),
            (None, Some(_)) => Some(format!(
                "{from} sent a proof but no shared secret is configured here"
            )),
            (None, None) => None,
        };
        if let Some(why) = refusal {
            return Err(conn.refuse_with(ErrorCode::Auth, cfg.name, why));
        }
        Ok(ServerHandshake {
            hello,
            challenge,
            secret: cfg.secret.map(<[u8]>::to_vec),
            name: cfg.name.to_string(),
        })
    }

    /// The client's (authenticated) hello: its name and whether it asks for a takeover.
    pub fn hello(&self) -> &ClientHello {
        &self.hello
    }

    /// Answer with the chain (this worker first), proving the secret over it when one is set.
    pub fn finish(self, conn: &mut Conn, chain: Vec<StageDesc>) -> Result<()> {
        let proof = match &self.secret {
            Some(secret) => {
                let transcript = auth::worker_transcript(&self.hello, &self.challenge, &chain)?;
                Some(auth::prove(secret, Role::Worker, &transcript)?)
            }
            None => None,
        };
        conn.limit_width(&chain);
        conn.send(&Message::HelloReply(HelloReply { chain, proof }))
    }

    /// Refuse the client instead of answering (busy, a downstream failure relayed with its own stage
    /// name); returns the local error.
    pub fn refuse(self, conn: &mut Conn, err: ErrorMsg) -> QkError {
        conn.refuse(&err);
        conn.fail(format!("refused {}: {err}", self.hello.name))
    }

    /// This stage's name, as given in its config.
    pub fn stage_name(&self) -> &str {
        &self.name
    }
}

/// One head session per worker chain (docs/protocol.md "Sessions"): a worker's gate admits one session at a time; a
/// second hello is refused "busy" unless it asks for a takeover. A takeover marks the live session
/// replaced (by whom, when): its serve loop sees that on its ticket between requests and ends the
/// session with a "taken over" ERROR, so the head that lost the chain learns who took it and when.
#[derive(Clone, Default)]
pub struct SessionGate {
    state: Arc<Mutex<GateState>>,
}

#[derive(Default)]
struct GateState {
    generation: u64,
    live: Option<LiveSession>,
    /// Sessions replaced by a takeover whose tickets are still held: generation → who and when.
    replaced: HashMap<u64, Takeover>,
}

struct LiveSession {
    generation: u64,
    head: String,
}

/// Who took a session over, and when.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Takeover {
    pub head: String,
    pub at: SystemTime,
}

impl Takeover {
    /// The ERROR a taken-over session ends with (code TakenOver): "taken over by head 'X' at T".
    pub fn error(&self, stage: &str) -> ErrorMsg {
        ErrorMsg::new(
            ErrorCode::TakenOver,
            stage,
            format!("taken over by head '{}' at {}", self.head, utc_timestamp(self.at)),
        )
    }
}

/// `at` as an RFC 3339 UTC timestamp to the second ("2026-11-29T08:15:02Z").
pub fn utc_timestamp(at: SystemTime) -> String {
    let secs = at
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (proleptic Gregorian; eras of 400 years = 146097 days).
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

fn lock(state: &Mutex<GateState>) -> MutexGuard<'_, GateState> {
    // A panic elsewhere while holding the lock leaves plain data behind; keep using it.
    state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl SessionGate {
    pub fn new() -> SessionGate {
        SessionGate::default()
    }

    /// Admit the session of `hello`, or refuse it "busy" (an ERROR to send with
    /// `ServerHandshake::refuse`). A takeover marks the live session replaced; that session's loop
    /// ends it (`SessionTicket::taken_over`).
    pub fn begin(&self, stage: &str, hello: &ClientHello) -> std::result::Result<SessionTicket, ErrorMsg> {
        let mut state = lock(&self.state);
        if let Some(live) = state.live.take() {
            if !hello.takeover {
                let why = format!(
                    "a head session is live (from '{}'); '{}' may connect with takeover to replace it",
                    live.head, hello.name
                );
                state.live = Some(live);
                return Err(ErrorMsg::new(ErrorCode::Busy, stage, why));
            }
            let takeover = Takeover {
                head: hello.name.clone(),
                at: SystemTime::now(),
            };
            state.replaced.insert(live.generation, takeover);
        }
        state.generation += 1;
        let generation = state.generation;
        state.live = Some(LiveSession {
            generation,
            head: hello.name.clone(),
        });
        Ok(SessionTicket {
            state: Arc::clone(&self.state),
            generation,
        })
    }

    /// Whether a session is live now.
    pub fn is_live(&self) -> bool {
        lock(&self.state).live.is_some()
    }
}

/// A live session's hold on the gate; dropping it frees the gate unless a takeover already did.
pub struct SessionTicket {
    state: Arc<Mutex<GateState>>,
    generation: u64,
}

impl SessionTicket {
    /// False once another head took the session over.
    pub fn is_current(&self) -> bool {
        lock(&self.state)
            .live
            .as_ref()
            .is_some_and(|l| l.generation == self.generation)
    }

    /// Who took this session over and when, once another head did.
    pub fn taken_over(&self) -> Option<Takeover> {
        lock(&self.state).replaced.get(&self.generation).cloned()
    }
}

impl Drop for SessionTicket {
    fn drop(&mut self) {
        let mut state = lock(&self.state);
        state.replaced.remove(&self.generation);
        if state
            .live
            .as_ref()
            .is_some_and(|l| l.generation == self.generation)
        {
            state.live = None;
        }
    }
}
