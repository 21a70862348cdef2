//! The split's transport alone: a head's `HeadLink` sending decode STEPs of one 80B-wide hidden row
//! (2048 f32) to a `serve_worker` thread over loopback, whose stage answers one id at once, or after
//! a busy wait standing in for its GPU. Prints the round trip's median and p90 with the sockets'
//! waits polling (what `qk.worker` and the head do on a GPU) and sleeping: the per-token link cost
//! a split pays on top of its two stages' engines, without a GPU in the way.
//!   cargo bench --no-default-features --bench link
//! QK_LINK_STEPS: round trips per case (default 3000).

use std::net::TcpListener;
use std::thread;
use std::time::{Duration, Instant};

use qk::error::Result;
use qk::transport::{
    HeadConfig, HeadLink, HiddenRows, Rows, RunOut, Stage, StageInfo, StepEntry, StepOut, Timeouts,
    WorkerConfig, WorkerControl, serve_worker,
};

const N_EMBD: u32 = 2048;

/// The last stage of a 48-layer model that answers every step with id 0 after `busy`.
struct Tail {
    info: StageInfo,
    busy: Duration,
    pos: u32,
}

impl Stage for Tail {
    fn describe(&self) -> Result<StageInfo> {
        Ok(self.info.clone())
    }

    fn run(&mut self, _slot: u32, base: u32, input: &Rows, _topk: u32) -> Result<RunOut> {
        let n = match input {
            Rows::Tokens(t) => t.len(),
            Rows::Hidden(h) => h.data.len() / N_EMBD as usize,
        };
        self.pos = base + n as u32;
        Ok(RunOut::Ids {
            ids: vec![0; n],
            topk: Vec::new(),
        })
    }

    fn step(&mut self, entries: &[StepEntry], _input: &Rows, _topk: u32) -> Result<StepOut> {
        let t = Instant::now();
        while t.elapsed() < self.busy {
            std::hint::spin_loop();
        }
        self.pos += 1;
        Ok(StepOut::Ids {
            ids: vec![0; entries.len()],
            topk: vec![Vec::new(); entries.len()],
        })
    }

    fn position(&self, _slot: u32) -> Result<u32> {
        Ok(self.pos)
    }

    fn save(&mut self, _slot: u32, _idx: u32) -> Result<()> {
        Ok(())
    }

    fn load(&mut self, _slot: u32, _idx: u32) -> Result<()> {
        Ok(())
    }

    fn drop_snapshot(&mut self, _idx: u32) -> Result<()> {
        Ok(())
    }

    fn reset(&mut self) -> Result<()> {
        self.pos = 0;
        Ok(())
    }
}

fn info(first: u32, end: u32) -> StageInfo {
    StageInfo {
        layer_first: first,
        layer_end: end,
        n_layer: 48,
        n_embd: N_EMBD,
        slots: 1,
        ctx: 1 << 20,
        snap_entries: 0,
        snap_bytes: 0,
        fingerprint: "link bench".into(),
        adapter: "none".into(),
    }
}

/// Round trips of one STEP through a worker polling (or not) for `spin`, its stage busy for `busy`:
/// (median, p90) of the round trip minus `busy`, in µs.
fn case(spin: Duration, busy: Duration, steps: usize) -> (f64, f64) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    let addr = listener.local_addr().expect("address").to_string();
    let timeouts = Timeouts {
        spin,
        ..Timeouts::default()
    };
    let mut wcfg = WorkerConfig::new("tail");
    wcfg.timeouts = timeouts;
    let control = WorkerControl::new();
    let c = control.clone();
    let worker = thread::spawn(move || {
        let mut tail = Tail {
            info: info(24, 48),
            busy,
            pos: 0,
        };
        serve_worker(&listener, &mut tail, &wcfg, &c)
    });
    let mut hcfg = HeadConfig::new(&addr, info(0, 24).describe_as("head", 1));
    hcfg.timeouts = timeouts;
    let mut link = HeadLink::new(hcfg);
    let deadline = Instant::now() + Duration::from_secs(10);
    while link.connect().is_err() {
        assert!(Instant::now() < deadline, "the worker never answered the hello");
        thread::sleep(Duration::from_millis(10));
    }
    link.run(0, 0, Rows::Tokens(vec![1]), 0)
        .expect("a first position");
    let row: Vec<f32> = (0..N_EMBD).map(|i| i as f32 * 1e-3).collect();
    let mut times = Vec::with_capacity(steps);
    for i in 0..steps + steps / 10 {
        let entries = vec![StepEntry {
            slot: 0,
            base: 1 + i as u32,
        }];
        let hidden = HiddenRows {
            width: N_EMBD,
            data: row.clone(),
        };
        let t = Instant::now();
        link.step(entries, Rows::Hidden(hidden), 0).expect("step");
        // The first tenth warms the path up.
        if i >= steps / 10 {
            times.push((t.elapsed().saturating_sub(busy)).as_secs_f64() * 1e6);
        }
    }
    drop(link);
    control.stop();
    worker.join().expect("worker thread").expect("worker");
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], times[times.len() * 9 / 10])
}

fn main() {
    let steps: usize = std::env::var("QK_LINK_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3000);
    let spin = Duration::from_millis(20);
    for (name, spin) in [("polling", spin), ("sleeping", Duration::ZERO)] {
        for busy_us in [0u64, 500] {
            let (median, p90) = case(spin, Duration::from_micros(busy_us), steps);
            println!(
                "link, sockets {name:>8}, stage busy {busy_us:>3} µs: STEP of one 2048-float row, round trip \
                 beyond the stage median {median:>6.1} µs, p90 {p90:>6.1} µs"
            );
        }
    }
}
