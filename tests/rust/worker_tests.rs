//! Split-serving tests over loopback: `serve_worker` chains of 2 and 3 stages around a deterministic
//! test-double `Stage`, driven by a `HeadLink`, against the same stages composed in-process; SAVE /
//! LOAD through the chain; hello refusals reaching the head with their reason; a stage killed and
//! restarted mid-session; malformed frames closing only their own connection; takeover only when
//! asked, and the head that lost the chain told who took it and when; before the proof, nothing but
//! a hello-sized frame read, few connections pending and none for long. The head's pipeline
//! (`SplitHead`): prompts cut into pieces, steps in flight two at a time, snapshots, a chain
//! restarted while idle, the idle link looked after; and on a GPU, native engine stages at both ends
//! equal to the unsplit engine.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use qk::error::{QkError, Result};
use qk::transport::frame::{self, ErrorCode, HEADER_LEN, Header, Op, VERSION};
use qk::transport::{
    ClientHello, HeadConfig, HeadLink, HiddenRows, Message, Proof, Rows, RunOut, SplitConfig, SplitHead,
    Stage, StageDesc, StageInfo, StepEntry, StepOut, Timeouts, WorkerConfig, WorkerControl, decode, encode,
    serve_worker,
};

const N_LAYER: u32 = 6;
const N_EMBD: u32 = 4;
const VOCAB: u32 = 1000;
const FINGERPRINT: &str = "test-double-model";

/// A stage whose output depends on its layers, on every row the slot saw before (a running sum per
/// slot, so SAVE/LOAD and base checks matter) and on nothing else.
#[derive(Clone)]
struct Double {
    info: StageInfo,
    /// Per slot: the position, and the running sum of the rows this stage saw.
    slots: Vec<Option<(u32, Vec<f32>)>>,
    snapshots: HashMap<u32, (u32, Vec<f32>)>,
    /// Keep values bounded (a decaying sum, tanh), so prompts of hundreds of positions stay finite.
    damped: bool,
}

impl Double {
    fn new(first: u32, end: u32) -> Double {
        Double::with(first, end, |_| {})
    }

    fn with(first: u32, end: u32, edit: impl FnOnce(&mut StageInfo)) -> Double {
        let mut info = StageInfo {
            layer_first: first,
            layer_end: end,
            n_layer: N_LAYER,
            n_embd: N_EMBD,
            slots: 4,
            ctx: 256,
            snap_entries: 4,
            snap_bytes: 1 << 20,
            fingerprint: FINGERPRINT.to_string(),
            adapter: "test double".to_string(),
        };
        edit(&mut info);
        Double {
            slots: vec![None; info.slots as usize],
            snapshots: HashMap::new(),
            info,
            damped: false,
        }
    }

    fn damped(first: u32, end: u32) -> Double {
        Double {
            damped: true,
            ..Double::new(first, end)
        }
    }

    fn desc(&self, name: &str) -> StageDesc {
        self.info.describe_as(name, 1)
    }

    fn fail(msg: String) -> QkError {
        QkError::Engine(msg)
    }

    /// The rows this stage sees: hidden rows as given, or token ids embedded.
    fn input_rows(&self, input: &Rows) -> Result<Vec<Vec<f32>>> {
        match input {
            Rows::Tokens(ids) if self.info.layer_first == 0 => Ok(ids
                .iter()
                .map(|&t| (0..N_EMBD).map(|j| t as f32 + j as f32 * 0.5).collect())
                .collect()),
            Rows::Tokens(_) => Err(Double::fail(
                "token ids given to a stage that does not embed".into(),
            )),
            Rows::Hidden(h) => Ok(h.data.chunks(h.width as usize).map(<[f32]>::to_vec).collect()),
        }
    }

    /// Positions [base, base + rows) of `slot`; returns the output rows.
    fn advance(&mut self, slot: u32, base: u32, rows: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>> {
        let state = self
            .slots
            .get_mut(slot as usize)
            .ok_or_else(|| Double::fail(format!("slot {slot} out of range")))?;
        if base == 0 {
            *state = Some((0, vec![0.0; N_EMBD as usize]));
        }
        let Some((pos, acc)) = state.as_mut() else {
            return Err(Double::fail(format!("slot {slot} was never started")));
        };
        if *pos != base {
            return Err(Double::fail(format!("base {base}, but slot {slot} is at {pos}")));
        }
        let mut out = Vec::new();
        for mut row in rows {
            for layer in self.info.layer_first..self.info.layer_end {
                for (j, x) in row.iter_mut().enumerate() {
                    if self.damped {
                        acc[j] = acc[j] * 0.5 + *x;
                        *x = (*x * 0.5 + layer as f32 / 10.0 + acc[j] * 0.25).tanh();
                    } else {
                        acc[j] += *x;
                        *x = *x * 0.5 + layer as f32 + acc[j] * 0.25;
                    }
                }
            }
            out.push(row);
            *pos += 1;
        }
        Ok(out)
    }

    fn id_of(row: &[f32]) -> u32 {
        let h = row
            .iter()
            .fold(0x811c_9dc5u32, |h, x| (h ^ x.to_bits()).wrapping_mul(0x0100_0193));
        h % VOCAB
    }

    fn topk_of(row: &[f32], k: u32) -> Vec<(u32, f32)> {
        let id = Double::id_of(row);
        (0..k)
            .map(|i| ((id + i) % VOCAB, row[i as usize % row.len()] - i as f32))
            .collect()
    }

    fn hidden(rows: Vec<Vec<f32>>) -> HiddenRows {
        HiddenRows {
            width: N_EMBD,
            data: rows.into_iter().flatten().collect(),
        }
    }
}

impl Stage for Double {
    fn describe(&self) -> Result<StageInfo> {
        Ok(self.info.clone())
    }

    fn run(&mut self, slot: u32, base: u32, input: &Rows, topk: u32) -> Result<RunOut> {
        let rows = self.input_rows(input)?;
        let out = self.advance(slot, base, rows)?;
        if !self.info.is_last() {
            return Ok(RunOut::Hidden(Double::hidden(out)));
        }
        let topk = out.last().map_or(Vec::new(), |r| Double::topk_of(r, topk));
        Ok(RunOut::Ids {
            ids: out.iter().map(|r| Double::id_of(r)).collect(),
            topk,
        })
    }

    fn step(&mut self, entries: &[StepEntry], input: &Rows, topk: u32) -> Result<StepOut> {
        let rows = self.input_rows(input)?;
        let mut out = Vec::new();
        for (e, row) in entries.iter().zip(rows) {
            out.extend(self.advance(e.slot, e.base, vec![row])?);
        }
        if !self.info.is_last() {
            return Ok(StepOut::Hidden(Double::hidden(out)));
        }
        Ok(StepOut::Ids {
            ids: out.iter().map(|r| Double::id_of(r)).collect(),
            topk: out.iter().map(|r| Double::topk_of(r, topk)).collect(),
        })
    }

    fn position(&self, slot: u32) -> Result<u32> {
        match self.slots.get(slot as usize) {
            Some(state) => Ok(state.as_ref().map_or(0, |(pos, _)| *pos)),
            None => Err(Double::fail(format!("slot {slot} out of range"))),
        }
    }

    fn save(&mut self, slot: u32, idx: u32) -> Result<()> {
        if idx >= self.info.snap_entries {
            return Err(Double::fail(format!("snapshot {idx} out of range")));
        }
        let state = self.slots.get(slot as usize).cloned().flatten();
        let state = state.ok_or_else(|| Double::fail(format!("slot {slot} has no state to save")))?;
        self.snapshots.insert(idx, state);
        Ok(())
    }

    fn load(&mut self, slot: u32, idx: u32) -> Result<()> {
        let snap = self.snapshots.get(&idx).cloned();
        let snap = snap.ok_or_else(|| Double::fail(format!("no snapshot {idx}")))?;
        let state = self
            .slots
            .get_mut(slot as usize)
            .ok_or_else(|| Double::fail(format!("slot {slot} out of range")))?;
        *state = Some(snap);
        Ok(())
    }

    fn drop_snapshot(&mut self, idx: u32) -> Result<()> {
        self.snapshots.remove(&idx);
        Ok(())
    }

    fn reset(&mut self) -> Result<()> {
        self.slots.iter_mut().for_each(|s| *s = None);
        self.snapshots.clear();
        Ok(())
    }
}

/// The head's own stage and the chain composed in-process: the reference a split run must equal.
struct Composed {
    stages: Vec<Double>,
}

impl Composed {
    fn new(bounds: &[u32]) -> Composed {
        Composed {
            stages: bounds.windows(2).map(|w| Double::new(w[0], w[1])).collect(),
        }
    }

    fn damped(bounds: &[u32]) -> Composed {
        Composed {
            stages: bounds.windows(2).map(|w| Double::damped(w[0], w[1])).collect(),
        }
    }

    fn run(&mut self, slot: u32, base: u32, tokens: &[u32], topk: u32) -> (Vec<u32>, Vec<(u32, f32)>) {
        let mut rows = Rows::Tokens(tokens.to_vec());
        for stage in &mut self.stages {
            match stage.run(slot, base, &rows, topk).expect("in-process run") {
                RunOut::Hidden(h) => rows = Rows::Hidden(h),
                RunOut::Ids { ids, topk } => return (ids, topk),
            }
        }
        panic!("the composed chain did not end in ids");
    }

    fn step(&mut self, entries: &[StepEntry], tokens: &[u32], topk: u32) -> (Vec<u32>, Vec<Vec<(u32, f32)>>) {
        let mut rows = Rows::Tokens(tokens.to_vec());
        for stage in &mut self.stages {
            match stage.step(entries, &rows, topk).expect("in-process step") {
                StepOut::Hidden(h) => rows = Rows::Hidden(h),
                StepOut::Ids { ids, topk } => return (ids, topk),
            }
        }
        panic!("the composed chain did not end in ids");
    }
}

fn timeouts() -> Timeouts {
    Timeouts {
        connect: Duration::from_secs(2),
        hello: Duration::from_secs(5),
        pre_auth: Duration::from_secs(5),
        base: Duration::from_secs(5),
        per_row: Duration::from_millis(1),
        spin: Duration::ZERO,
    }
}

struct Running {
    addr: String,
    control: WorkerControl,
    thread: JoinHandle<Result<()>>,
}

impl Running {
    fn stop(self) -> Result<()> {
        self.control.stop();
        self.thread.join().expect("the worker thread panicked")
    }
}

fn listener() -> TcpListener {
    TcpListener::bind("127.0.0.1:0").expect("bind a loopback port")
}

fn addr_of(l: &TcpListener) -> String {
    l.local_addr().expect("local address").to_string()
}

fn spawn_on(listener: TcpListener, mut stage: Double, cfg: WorkerConfig) -> Running {
    let addr = addr_of(&listener);
    let control = WorkerControl::new();
    let c = control.clone();
    let thread = thread::spawn(move || serve_worker(&listener, &mut stage, &cfg, &c));
    Running {
        addr,
        control,
        thread,
    }
}

fn worker_cfg(name: &str, next: Option<&str>) -> WorkerConfig {
    let mut cfg = WorkerConfig::new(name);
    cfg.next = next.map(str::to_string);
    cfg.timeouts = timeouts();
    cfg
}

/// Workers for the stages after the head, started last to first; returns them and stage 2's address.
fn chain(stages: Vec<(&str, Double)>) -> Vec<Running> {
    let mut running: Vec<Running> = Vec::new();
    for (name, stage) in stages.into_iter().rev() {
        let next = running.last().map(|r| r.addr.clone());
        running.push(spawn_on(listener(), stage, worker_cfg(name, next.as_deref())));
    }
    running.reverse();
    running
}

fn head(addr: &str, own: &Double) -> HeadLink {
    let mut cfg = HeadConfig::new(addr, own.desc("head"));
    cfg.timeouts = timeouts();
    cfg.backoff_min = Duration::from_millis(20);
    cfg.backoff_max = Duration::from_millis(200);
    HeadLink::new(cfg)
}

/// What the head sends for tokens: its own layers' hidden rows.
fn head_rows(own: &mut Double, slot: u32, base: u32, tokens: &[u32]) -> Rows {
    match own
        .run(slot, base, &Rows::Tokens(tokens.to_vec()), 0)
        .expect("head stage")
    {
        RunOut::Hidden(h) => Rows::Hidden(h),
        RunOut::Ids { .. } => panic!("the head stage ends the model"),
    }
}

fn head_step_rows(own: &mut Double, entries: &[StepEntry], tokens: &[u32]) -> Rows {
    match own
        .step(entries, &Rows::Tokens(tokens.to_vec()), 0)
        .expect("head stage")
    {
        StepOut::Hidden(h) => Rows::Hidden(h),
        StepOut::Ids { .. } => panic!("the head stage ends the model"),
    }
}

fn stop_all(workers: Vec<Running>) {
    for w in workers {
        w.stop().expect("worker ended with an error");
    }
}

/// A prefill in two frames on two slots, then decode steps over both: every answer equals the
/// in-process composition of the same stages.
fn check_chain_matches(bounds: &[u32]) {
    let mut reference = Composed::new(bounds);
    let mut own = Double::new(bounds[0], bounds[1]);
    let names = ["w1", "w2", "w3"];
    let workers = chain(
        bounds[1..]
            .windows(2)
            .zip(names)
            .map(|(w, name)| (name, Double::new(w[0], w[1])))
            .collect(),
    );
    let mut link = head(&workers[0].addr, &own);
    let got = link.connect().expect("hello").to_vec();
    assert_eq!(got.len(), bounds.len() - 2);
    assert_eq!(got[0].name, "w1");
    assert_eq!(got.last().map(|s| s.layer_end), Some(N_LAYER));

    let prompts: [&[u32]; 2] = [&[11, 12, 13, 14, 15], &[7, 8, 9]];
    for (slot, prompt) in prompts.iter().enumerate() {
        let slot = slot as u32;
        let (first, rest) = prompt.split_at(2);
        for (base, part) in [(0, first), (2, rest)] {
            let want = reference.run(slot, base, part, 3);
            let rows = head_rows(&mut own, slot, base, part);
            let result = link.run(slot, base, rows, 3).expect("split run");
            assert_eq!((result.ids, result.topk), want, "slot {slot} base {base}");
        }
    }
    let mut bases = [5u32, 3u32];
    let mut next_tokens = [1u32, 2u32];
    for _ in 0..3 {
        let entries = vec![
            StepEntry {
                slot: 0,
                base: bases[0],
            },
            StepEntry {
                slot: 1,
                base: bases[1],
            },
        ];
        let want = reference.step(&entries, &next_tokens, 2);
        let rows = head_step_rows(&mut own, &entries, &next_tokens);
        let result = link.step(entries, rows, 2).expect("split step");
        assert_eq!((result.ids.clone(), result.topk), want);
        next_tokens = [result.ids[0], result.ids[1]];
        bases = [bases[0] + 1, bases[1] + 1];
    }
    assert!(link.ping().expect("ping") < Duration::from_secs(5));
    link.close();
    stop_all(workers);
}

#[test]
fn two_stage_chain_equals_in_process_composition() {
    check_chain_matches(&[0, 2, N_LAYER]);
}

#[test]
fn three_stage_chain_equals_in_process_composition() {
    check_chain_matches(&[0, 1, 4, N_LAYER]);
}

#[test]
fn save_and_load_apply_on_every_stage() {
    let mut own = Double::new(0, 2);
    let w2 = Double::with(4, N_LAYER, |i| i.snap_entries = 3);
    let workers = chain(vec![("w1", Double::new(2, 4)), ("w2", w2)]);
    let mut link = head(&workers[0].addr, &own);
    let rows = head_rows(&mut own, 0, 0, &[3, 4, 5]);
    link.run(0, 0, rows, 0).expect("prefix");
    let own_saved = own.clone();
    link.save(0, 2).expect("save through the chain");
    let rows = head_rows(&mut own, 0, 3, &[6, 7]);
    let first = link.run(0, 3, rows.clone(), 4).expect("continuation");

    // A different continuation moves every stage's state on; loading must bring all of them back.
    let other = head_rows(&mut own, 0, 5, &[100]);
    link.run(0, 5, other, 0).expect("a different continuation");
    own = own_saved;
    link.load(0, 2).expect("load through the chain");
    let again = link.run(0, 3, rows, 4).expect("continuation after load");
    assert_eq!(again, first);

    // A stage's own failure names it, and the link stays up.
    let err = link.load(1, 3).expect_err("snapshot 3 was never saved");
    let text = err.to_string();
    assert!(
        text.contains("stage 'w1'") && text.contains("no snapshot 3"),
        "{text}"
    );
    assert!(link.is_up());
    link.drop_snapshot(2).expect("drop through the chain");
    let err = link.load(0, 2).expect_err("snapshot 2 was dropped");
    assert_eq!(
        link.last_peer_error().map(|e| e.code),
        Some(ErrorCode::Stage),
        "{err}"
    );

    // A failure on the last stage (w1 saved entry 3, w2 has only 3 entries) is relayed with its name.
    let err = link.save(0, 3).expect_err("w2 has no entry 3");
    let text = err.to_string();
    assert!(
        text.contains("stage 'w2'") && text.contains("snapshot 3 out of range"),
        "{text}"
    );
    assert!(link.is_up());

    // A failure on the first worker names it.
    let mut scratch = Double::new(0, 2);
    let rows = head_rows(&mut scratch, 1, 0, &[1]);
    let err = link.run(1, 9, rows, 0).expect_err("base 9 on a fresh slot");
    assert!(err.to_string().contains("stage 'w1'"), "{err}");
    let _ = own;
    link.close();
    stop_all(workers);
}

/// The head's hello against `workers`, which must be refused with every part of `expect` in the text.
fn refused(own: &Double, workers: Vec<Running>, secret: Option<&[u8]>, expect: &[&str]) {
    let mut link = head(&workers[0].addr, own);
    let mut cfg = link.config().clone();
    cfg.secret = secret.map(<[u8]>::to_vec);
    link = HeadLink::new(cfg);
    let err = link.connect().expect_err("the chain must be refused");
    let text = err.to_string();
    for e in expect {
        assert!(text.contains(e), "{text:?} lacks {e:?}");
    }
    assert!(!link.is_up());
    stop_all(workers);
}

#[test]
fn hello_refusals_reach_the_head_with_their_reason() {
    let own = Double::new(0, 2);
    // A gap at the head's boundary, checked by the head.
    refused(
        &own,
        chain(vec![("w1", Double::new(3, N_LAYER))]),
        None,
        &["chain refused", "'w1'", "starts at layer 3"],
    );
    // A gap in the middle of the chain, refused by the middle stage and relayed.
    refused(
        &own,
        chain(vec![("w1", Double::new(2, 3)), ("w2", Double::new(4, N_LAYER))]),
        None,
        &["chain refused", "stage 'w1'", "starts at layer 4"],
    );
    refused(
        &own,
        chain(vec![(
            "w1",
            Double::with(2, N_LAYER, |i| i.fingerprint = "another-model".into()),
        )]),
        None,
        &["chain refused", "fingerprint another-model"],
    );
    refused(
        &own,
        chain(vec![("w1", Double::with(2, N_LAYER, |i| i.slots = 2))]),
        None,
        &["chain refused", "2 slots, fewer than the 4"],
    );
    refused(
        &own,
        chain(vec![("w1", Double::with(2, N_LAYER, |i| i.ctx = 16))]),
        None,
        &["chain refused", "ctx 16"],
    );
    let mut cfg = worker_cfg("w1", None);
    cfg.secret = Some(b"worker secret".to_vec());
    refused(
        &own,
        vec![spawn_on(listener(), Double::new(2, N_LAYER), cfg)],
        Some(b"head secret"),
        &["authentication failed"],
    );
    refused(
        &own,
        chain(vec![("w1", Double::new(2, N_LAYER))]),
        Some(b"head secret"),
        &["authentication failed"],
    );
}

#[test]
fn a_worker_refuses_a_configuration_its_layers_contradict() {
    let middle = spawn_on(listener(), Double::new(2, 4), worker_cfg("w1", None));
    let err = middle
        .thread
        .join()
        .expect("no panic")
        .expect_err("no next stage");
    assert!(err.to_string().contains("needs a next stage"), "{err}");
    let last = spawn_on(
        listener(),
        Double::new(2, N_LAYER),
        worker_cfg("w1", Some("127.0.0.1:1")),
    );
    let err = last
        .thread
        .join()
        .expect("no panic")
        .expect_err("a next stage after the last");
    assert!(err.to_string().contains("yet a next stage"), "{err}");
}

#[test]
fn a_foreign_version_is_refused_naming_both_versions() {
    let workers = chain(vec![("w1", Double::new(2, N_LAYER))]);
    let mut stream = TcpStream::connect(&workers[0].addr).expect("connect");
    let mut hello = encode(&Message::Hello(ClientHello {
        nonce: [1; 32],
        name: "old head".into(),
        takeover: false,
        has_secret: false,
    }))
    .expect("encode");
    hello[4..8].copy_from_slice(&(VERSION - 1).to_le_bytes());
    stream.write_all(&hello).expect("send");
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut reply = Vec::new();
    stream
        .read_to_end(&mut reply)
        .expect("the worker answers, then closes");
    let Message::Error(err) = decode(&reply).expect("an ERROR frame") else {
        panic!("expected an error");
    };
    assert_eq!(err.code, ErrorCode::Version);
    assert!(err.message.contains(&format!("version {}", VERSION - 1)), "{err}");
    assert!(err.message.contains(&format!("version {VERSION}")), "{err}");
    stop_all(workers);
}

#[test]
fn a_second_head_is_busy_unless_it_takes_over() {
    let own = Double::new(0, 2);
    let workers = chain(vec![("w1", Double::new(2, N_LAYER))]);
    let mut first = head(&workers[0].addr, &own);
    first.connect().expect("first head");
    let mut second = HeadLink::new(HeadConfig {
        own: own.desc("head-b"),
        ..head(&workers[0].addr, &own).config().clone()
    });
    assert!(!second.config().takeover, "takeover is opt-in");
    let err = second.connect().expect_err("busy");
    assert!(err.to_string().contains("busy"), "{err}");
    first.ping().expect("the first head keeps the chain");
    let mut cfg = second.config().clone();
    cfg.takeover = true;
    let mut second = HeadLink::new(cfg);
    second.connect().expect("takeover");
    second.ping().expect("the new session serves");

    // The first head is told, unasked and between calls, who took the chain and when.
    let deadline = Instant::now() + Duration::from_secs(5);
    while first.poll() {
        assert!(
            Instant::now() < deadline,
            "no takeover notice reached the first head"
        );
        thread::sleep(Duration::from_millis(20));
    }
    let taken = first.taken_over().expect("taken over").to_string();
    assert!(taken.starts_with("taken over by head 'head-b' at 20"), "{taken}");
    assert!(taken.ends_with('Z'), "{taken}");
    // Its calls fail at once with that, instead of asking the worker (which would say busy).
    let err = first
        .ping()
        .expect_err("the chain is the second head's")
        .to_string();
    assert!(err.contains(&taken), "{err}");
    assert!(first.reconnect_if_due().is_none() || first.taken_over().is_some());
    // Once the second head lets go, the background retry gets the chain back (without takeover).
    second.close();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        thread::sleep(Duration::from_millis(50));
        if let Some(Ok(())) = first.reconnect_if_due() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the first head never got the chain back"
        );
    }
    assert_eq!(first.taken_over(), None);
    first.ping().expect("served again");
    first.close();
    stop_all(workers);
}

#[test]
fn a_head_taken_over_mid_call_gets_the_notice_as_its_reply() {
    let mut own = Double::new(0, 2);
    let workers = chain(vec![("w1", Double::new(2, N_LAYER))]);
    let mut first = head(&workers[0].addr, &own);
    first.connect().expect("first head");
    let mut cfg = head(&workers[0].addr, &own).config().clone();
    cfg.own = own.desc("head-b");
    cfg.takeover = true;
    let mut second = HeadLink::new(cfg);
    second.connect().expect("takeover");
    let rows = head_rows(&mut own, 0, 0, &[1, 2]);
    let err = first.run(0, 0, rows, 0).expect_err("taken over").to_string();
    assert!(
        err.contains("session taken over: stage 'w1': taken over by head 'head-b' at "),
        "{err}"
    );
    assert!(!first.is_up());
    second.close();
    stop_all(workers);
}

/// A raw connection to `addr` with a read timeout.
fn raw(addr: &str) -> TcpStream {
    let stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    stream
}

/// A RUN header announcing the largest payload a frame may carry (4096 rows of 16384 floats).
fn huge_run_header() -> Vec<u8> {
    let mut h = Header::new(Op::Run);
    h.n = frame::MAX_ROWS;
    h.width = frame::MAX_WIDTH;
    h.len = frame::MAX_ROWS * frame::MAX_WIDTH * 4;
    frame::encode_header(&h).to_vec()
}

#[test]
fn before_the_proof_only_a_hello_sized_frame_is_read() {
    let workers = chain(vec![("w1", Double::new(2, N_LAYER))]);
    let addr = workers[0].addr.clone();
    // A 256 MiB RUN instead of a hello: refused from its header, its payload never awaited.
    let mut stream = raw(&addr);
    stream.write_all(&huge_run_header()).expect("send the header");
    let start = Instant::now();
    let Message::Error(err) = read_frame(&mut stream) else {
        panic!("expected an error");
    };
    assert!(start.elapsed() < Duration::from_secs(2), "{:?}", start.elapsed());
    assert_eq!(err.code, ErrorCode::BadFrame, "{err}");
    assert!(
        err.message
            .contains("expected a hello before authentication, got a run"),
        "{err}"
    );

    // The same in place of the proof, after a valid hello.
    let mut stream = raw(&addr);
    let hello = Message::Hello(ClientHello {
        nonce: [5; 32],
        name: "raw".into(),
        takeover: false,
        has_secret: false,
    });
    stream.write_all(&encode(&hello).expect("encode")).expect("hello");
    assert!(matches!(read_frame(&mut stream), Message::Challenge(_)));
    stream.write_all(&huge_run_header()).expect("send the header");
    let Message::Error(err) = read_frame(&mut stream) else {
        panic!("expected an error");
    };
    assert!(
        err.message
            .contains("expected a proof before authentication, got a run"),
        "{err}"
    );
    stop_all(workers);
}

#[test]
fn pending_connections_are_few_and_short_lived() {
    let mut cfg = worker_cfg("w1", None);
    cfg.max_pending = 4;
    cfg.timeouts.pre_auth = Duration::from_millis(400);
    let worker = spawn_on(listener(), Double::new(2, N_LAYER), cfg);
    let idle: Vec<TcpStream> = (0..4).map(|_| raw(&worker.addr)).collect();
    thread::sleep(Duration::from_millis(100));
    // A fifth is refused at once, before it sends anything.
    let mut fifth = raw(&worker.addr);
    let Message::Error(err) = read_frame(&mut fifth) else {
        panic!("expected a refusal");
    };
    assert_eq!(err.code, ErrorCode::Busy, "{err}");
    assert!(
        err.message.contains("4 connections are already in their hello"),
        "{err}"
    );
    // The idle ones are closed once their pre-auth time is up.
    let start = Instant::now();
    for mut s in idle {
        let mut buf = Vec::new();
        let _ = s.read_to_end(&mut buf);
        assert!(start.elapsed() < Duration::from_secs(3), "{:?}", start.elapsed());
    }
    // Then a head is served.
    let own = Double::new(0, 2);
    let mut link = head(&worker.addr, &own);
    link.ping()
        .expect("a head connects once the idle sockets are gone");
    link.close();
    worker.stop().expect("stopped");
}

#[test]
fn a_stage_killed_mid_session_fails_calls_then_the_link_reconnects() {
    let mut own = Double::new(0, 2);
    let last = listener();
    let last_addr = addr_of(&last);
    let w2 = spawn_on(last, Double::new(4, N_LAYER), worker_cfg("w2", None));
    let w1 = spawn_on(listener(), Double::new(2, 4), worker_cfg("w1", Some(&last_addr)));
    let mut link = head(&w1.addr, &own);
    let rows = head_rows(&mut own, 0, 0, &[1, 2]);
    let before = link.run(0, 0, rows.clone(), 2).expect("run before the kill");
    let boot_before = link.chain()[1].boot_id;

    w2.stop().expect("w2 stops");
    let err = link.run(0, 0, rows.clone(), 2).expect_err("w2 is gone");
    let text = err.to_string();
    assert!(
        text.contains("downstream unavailable") && text.contains("stage 'w1'"),
        "{text}"
    );
    assert!(!link.is_up());
    // While w2 is down, w1 refuses the hello itself, naming the missing stage.
    let err = link.run(0, 0, rows.clone(), 2).expect_err("w2 is still gone");
    assert!(err.to_string().contains(&last_addr), "{err}");

    // w2 comes back on the same port as a new process would (new boot id): the next call succeeds.
    let again = TcpListener::bind(&last_addr).expect("rebind w2's port");
    let w2 = spawn_on(again, Double::new(4, N_LAYER), worker_cfg("w2", None));
    let sessions = link.sessions();
    let after = link.run(0, 0, rows, 2).expect("run after the restart");
    assert_eq!(after, before);
    assert_eq!(link.sessions(), sessions + 1);
    assert_ne!(link.chain()[1].boot_id, boot_before);
    assert_eq!(link.take_restarted(), vec!["w2".to_string()]);

    // The head's own hop: kill w1, calls fail; background retries honour the backoff.
    let w1_addr = w1.addr.clone();
    w1.stop().expect("w1 stops");
    assert!(link.ping().is_err());
    assert!(
        link.reconnect_if_due().is_none(),
        "a retry right after a failure waits its backoff"
    );
    thread::sleep(Duration::from_millis(60));
    assert!(
        matches!(link.reconnect_if_due(), Some(Err(_))),
        "w1 is still down"
    );
    let w1 = spawn_on(
        TcpListener::bind(&w1_addr).expect("rebind w1's port"),
        Double::new(2, 4),
        worker_cfg("w1", Some(&last_addr)),
    );
    // A request does not wait out the backoff.
    assert!(link.retry_in().is_some_and(|d| d > Duration::ZERO));
    link.ping().expect("ping after w1 is back");
    link.close();
    stop_all(vec![w1, w2]);
}

#[test]
fn a_malformed_frame_closes_only_its_connection() {
    let mut own = Double::new(0, 2);
    let workers = chain(vec![("w1", Double::new(2, N_LAYER))]);
    let addr = workers[0].addr.clone();

    // Garbage instead of a hello, while a session is live: refused, the session goes on.
    let mut link = head(&addr, &own);
    link.connect().expect("hello");
    let mut junk = TcpStream::connect(&addr).expect("connect");
    junk.write_all(&[0x55; HEADER_LEN]).expect("send junk");
    junk.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut reply = Vec::new();
    let _ = junk.read_to_end(&mut reply);
    drop(junk);
    link.ping().expect("the live session is untouched");
    link.close();

    // A bad frame inside a session: that session ends with a BadFrame error; the worker serves on.
    let mut raw = TcpStream::connect(&addr).expect("connect");
    raw.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let hello = Message::Hello(ClientHello {
        nonce: [3; 32],
        name: "raw head".into(),
        takeover: false,
        has_secret: false,
    });
    raw.write_all(&encode(&hello).expect("encode")).expect("hello");
    assert!(matches!(read_frame(&mut raw), Message::Challenge(_)));
    raw.write_all(&encode(&Message::Proof(Proof { proof: None })).expect("encode"))
        .expect("proof");
    assert!(matches!(read_frame(&mut raw), Message::HelloReply(_)));
    let mut h = Header::new(Op::Run);
    h.n = 1;
    h.width = N_EMBD;
    // One hidden row is 16 bytes; the reader's header check refuses a length of 3.
    h.len = 3;
    let mut bad = frame::encode_header(&h).to_vec();
    bad.extend([0u8; 3]);
    raw.write_all(&bad).expect("send the bad frame");
    let Message::Error(err) = read_frame(&mut raw) else {
        panic!("expected an error for the bad frame");
    };
    assert_eq!(err.code, ErrorCode::BadFrame, "{err}");
    let mut rest = Vec::new();
    assert_eq!(
        raw.read_to_end(&mut rest).map(|_| rest.len()).unwrap_or(0),
        0,
        "then the worker closes"
    );
    // `raw` stays open: the worker's wait for it to close must not delay the next head.

    let mut link = head(&addr, &own);
    let rows = head_rows(&mut own, 0, 0, &[9]);
    let start = std::time::Instant::now();
    link.run(0, 0, rows, 0).expect("the next head is served");
    // Well under the worker's 2 s bound on waiting for a refused peer to close.
    assert!(start.elapsed() < Duration::from_secs(1), "{:?}", start.elapsed());
    drop(raw);
    link.close();
    stop_all(workers);
}

/// Read one whole frame from a raw socket.
fn read_frame(stream: &mut TcpStream) -> Message {
    let mut head = [0u8; HEADER_LEN];
    stream.read_exact(&mut head).expect("a frame header");
    let h = frame::decode_header(&head, &Default::default()).expect("a valid header");
    let mut bytes = head.to_vec();
    bytes.resize(HEADER_LEN + h.len as usize, 0);
    stream.read_exact(&mut bytes[HEADER_LEN..]).expect("the payload");
    decode(&bytes).expect("a valid frame")
}

fn split_head(own: Double, addr: &str, tick: Option<Duration>) -> SplitHead {
    let link = Arc::new(Mutex::new(head(addr, &own)));
    let cfg = SplitConfig {
        piece: 64,
        tick,
        ping_idle: Duration::from_millis(50),
    };
    SplitHead::new(Box::new(own), link, cfg).expect("a split head")
}

fn tokens(n: u32, seed: u32) -> Vec<u32> {
    (0..n).map(|i| (i * 37 + seed * 11) % 900).collect()
}

fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_split_head_equals_the_composition_in_pieces_and_in_lanes() {
    let bounds = [0, 2, 4, N_LAYER];
    let workers = chain(vec![
        ("w1", Double::damped(2, 4)),
        ("w2", Double::damped(4, N_LAYER)),
    ]);
    let head = split_head(Double::damped(0, 2), &workers[0].addr, None);
    let mut reference = Composed::damped(&bounds);
    assert_eq!(head.connect().expect("hello").len(), 2);

    // Slot 0: 150 positions in pieces of 64, 64 and 22. Slot 1: 10 positions, then 60 more from 10
    // (pieces of 54 and 6): a piece starts wherever the call starts and ends at a multiple of 64.
    let long = tokens(150, 1);
    let got = head.prefill(0, &long, 0, 3).expect("prefill of slot 0");
    let (ids, top) = reference.run(0, 0, &long, 3);
    assert_eq!(got.ids, ids[128..].to_vec(), "the final piece's ids");
    assert_eq!(got.topk, top);
    let (short, more) = (tokens(10, 2), tokens(60, 3));
    head.prefill(1, &short, 0, 0).expect("prefill of slot 1");
    reference.run(1, 0, &short, 0);
    let got = head
        .prefill(1, &more, 10, 2)
        .expect("continued prefill of slot 1");
    let (ids, top) = reference.run(1, 10, &more, 2);
    assert_eq!((got.ids, got.topk), (ids[54..].to_vec(), top));

    // Two steps in flight at once (one group on the head, the other on the chain), then one
    // step of both slots: each equals stepping the composition.
    let mut next = [7u32, 8u32];
    let mut bases = [150u32, 70u32];
    for round in 0..4 {
        let groups: Vec<Vec<usize>> = if round % 2 == 0 {
            vec![vec![0], vec![1]]
        } else {
            vec![vec![0, 1]]
        };
        let pending: Vec<_> = groups
            .iter()
            .map(|g| {
                let slots: Vec<u32> = g.iter().map(|&i| i as u32).collect();
                let toks: Vec<u32> = g.iter().map(|&i| next[i]).collect();
                head.step(&slots, &toks, 2).expect("step handed to the chain")
            })
            .collect();
        for (g, p) in groups.iter().zip(pending) {
            let got = p.wait().expect("step through the chain");
            let entries: Vec<StepEntry> = g
                .iter()
                .map(|&i| StepEntry {
                    slot: i as u32,
                    base: bases[i],
                })
                .collect();
            let toks: Vec<u32> = g.iter().map(|&i| next[i]).collect();
            let (ids, top) = reference.step(&entries, &toks, 2);
            assert_eq!((got.ids.clone(), got.topk), (ids, top), "round {round}");
            for (k, &i) in g.iter().enumerate() {
                next[i] = got.ids[k];
                bases[i] += 1;
            }
        }
    }
    let st = head.status();
    assert!(st.up && st.sessions == 1);
    assert_eq!(
        st.chain.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
        ["w1", "w2"]
    );
    assert_eq!((st.totals.steps, st.totals.rows), (6, 8));
    assert!(st.step_rtt.is_some() && st.totals.chain > Duration::ZERO);

    // A snapshot on every stage: resuming from it equals never having gone on.
    head.save(1, 2).expect("save on every stage");
    let cont = head.prefill(1, &[5], bases[1], 2).expect("one more position");
    head.prefill(1, &[6, 6, 6], bases[1] + 1, 0).expect("and more");
    head.load(1, 2).expect("load on every stage");
    assert_eq!(head.prefill(1, &[5], bases[1], 2).expect("resumed"), cont);
    head.drop_snapshot(2).expect("drop on every stage");
    assert!(head.load(1, 2).is_err(), "a dropped snapshot is gone on the head");

    // The head's own failure is its stage's, not the chain's.
    let err = head.prefill(9, &[1], 0, 0).expect_err("slot 9 does not exist");
    assert!(
        matches!(err, QkError::Engine(_)) && err.to_string().contains("slot 9"),
        "{err}"
    );
    head.close();
    let err = head.prefill(0, &[1], 0, 0).expect_err("closed");
    assert!(err.to_string().contains("closed"), "{err}");
    stop_all(workers);
}

#[test]
fn a_split_head_survives_a_restarted_chain() {
    let last = listener();
    let addr = addr_of(&last);
    let w1 = spawn_on(last, Double::damped(2, N_LAYER), worker_cfg("w1", None));
    let head = split_head(Double::damped(0, 2), &addr, None);
    let prompt = tokens(5, 4);
    let first = head.prefill(0, &prompt, 0, 2).expect("prefill");

    // Restarted while the head was idle: the prompt from base 0 goes through on the new session.
    w1.stop().expect("w1 stops");
    let w1 = spawn_on(
        TcpListener::bind(&addr).expect("rebind"),
        Double::damped(2, N_LAYER),
        worker_cfg("w1", None),
    );
    assert_eq!(
        head.prefill(0, &prompt, 0, 2).expect("retried on a new session"),
        first
    );
    assert_eq!(head.status().sessions, 2);
    assert_eq!(head.take_restarted(), vec!["w1".to_string()]);

    // A step (it continues a sequence, so it is never repeated) fails, saying where.
    w1.stop().expect("w1 stops again");
    let err = head
        .step(&[0], &[3], 0)
        .expect("the head's layers ran")
        .wait()
        .expect_err("the chain is gone");
    assert!(matches!(err, QkError::Transport(_)), "{err}");
    assert!(err.to_string().starts_with("pipeline stage failed"), "{err}");
    assert!(!head.status().up && head.status().last_error.is_some());
    head.close();
}

#[test]
fn an_idle_split_head_pings_and_reconnects_by_itself() {
    let last = listener();
    let addr = addr_of(&last);
    let w1 = spawn_on(last, Double::damped(2, N_LAYER), worker_cfg("w1", None));
    let head = split_head(Double::damped(0, 2), &addr, Some(Duration::from_millis(20)));
    head.connect().expect("hello");
    wait_until("an idle ping", || head.status().ping.is_some());
    w1.stop().expect("w1 stops");
    wait_until("the link is seen down", || !head.status().up);
    let w1 = spawn_on(
        TcpListener::bind(&addr).expect("rebind"),
        Double::damped(2, N_LAYER),
        worker_cfg("w1", None),
    );
    wait_until("the link reconnected", || {
        let st = head.status();
        st.up && st.sessions == 2
    });
    head.close();
    w1.stop().expect("w1 stops");
}

/// The tiny fixture's layers [a, b) on the adapter the tests use; None (and a note) without one.
fn fixture_engine(layers: Option<(u32, u32)>) -> Option<qk::engine::Engine> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/tiny-qwen3next-f32.gguf"
    );
    let opts = qk::engine::EngineOptions {
        layers,
        slots: 2,
        ctx: 256,
        precise: true,
        ..Default::default()
    };
    match qk::engine::Engine::load(path, &opts, &mut |_| {}) {
        Ok(e) => Some(e),
        Err(e @ QkError::Device(_)) => {
            assert!(
                std::env::var("QK_REQUIRE_GPU").as_deref() != Ok("1"),
                "QK_REQUIRE_GPU=1 but no device: {e}"
            );
            eprintln!("note: skipping native stage test, no device: {e}");
            None
        }
        Err(e) => panic!("load failed: {e}"),
    }
}

#[test]
fn native_stages_at_both_ends_equal_the_unsplit_engine() {
    use qk::engine::{StageInput, StageOutput};
    use qk::transport::EngineStage;
    let Some(mut whole) = fixture_engine(None) else {
        return;
    };
    let n_layer = whole.config().n_layer;
    let cut = n_layer / 2;
    let shared = |layers| {
        Arc::new(Mutex::new(
            fixture_engine(Some(layers)).expect("a stage's engine"),
        ))
    };
    let tail = EngineStage::new(shared((cut, n_layer)), "fixture", 4).expect("tail stage");
    let listener = listener();
    let addr = addr_of(&listener);
    let control = WorkerControl::new();
    let c = control.clone();
    let cfg = worker_cfg("tail", None);
    let served = thread::spawn(move || {
        let mut tail = tail;
        serve_worker(&listener, &mut tail, &cfg, &c)
    });
    let own = EngineStage::new(shared((0, cut)), "fixture", 4).expect("head stage");
    let mut link_cfg = HeadConfig::new(&addr, own.describe().expect("describe").describe_as("head", 1));
    link_cfg.timeouts = Timeouts {
        base: Duration::from_secs(60),
        ..timeouts()
    };
    let head = SplitHead::new(
        Box::new(own),
        Arc::new(Mutex::new(HeadLink::new(link_cfg))),
        SplitConfig {
            piece: 64,
            tick: None,
            ping_idle: Duration::from_secs(5),
        },
    )
    .expect("split head");

    // 70 positions (pieces of 64 and 6), then decode steps of both slots: ids and top-k identical.
    let prompt: Vec<u32> = (0..70).map(|i| (i * 13 + 5) % 200).collect();
    let got = head.prefill(0, &prompt, 0, 4).expect("split prefill");
    let StageOutput::Ids { ids, topk } = whole
        .stage_run(0, StageInput::Tokens(&prompt), 0, 4)
        .expect("unsplit prefill")
    else {
        panic!("the whole model answered hidden rows");
    };
    assert_eq!(got.topk, topk);
    assert_eq!(got.ids, ids[64..].to_vec());
    let second = [9u32, 10, 11];
    head.prefill(1, &second, 0, 0).expect("slot 1");
    whole
        .stage_run(1, StageInput::Tokens(&second), 0, 0)
        .expect("slot 1 unsplit");
    let mut next = [ids[69], 4u32];
    for round in 0..4 {
        // Engines of one process share one device, and so its counters.
        let before = whole.counters();
        let got = head
            .step(&[0, 1], &next, 3)
            .expect("step")
            .wait()
            .expect("chain step");
        let after = whole.counters();
        if round > 0 {
            // Past warm-up a step through the chain is one submit and one readback per stage,
            // and creates nothing: the Rust stage loop adds no GPU work of its own.
            let syncs = (after.submits - before.submits, after.readbacks - before.readbacks);
            assert_eq!(syncs, (2, 2));
            let created = (after.pipelines, after.bind_groups, after.buffers);
            assert_eq!(created, (before.pipelines, before.bind_groups, before.buffers));
        }
        let want = whole
            .step(&[0, 1], StageInput::Tokens(&next), 3)
            .expect("unsplit step");
        for (i, w) in want.into_iter().enumerate() {
            let StageOutput::Ids { ids, topk } = w else {
                panic!("hidden rows from the whole model");
            };
            assert_eq!((got.ids[i], &got.topk[i]), (ids[0], &topk));
        }
        next = [got.ids[0], got.ids[1]];
    }
    head.close();
    control.stop();
    served.join().expect("worker thread").expect("worker");
}
