//! Kernel micro-benchmark: device-to-device copy bandwidth (the baseline), mat-vec GB/s of weight
//! bytes per type, mat-mat GFLOP/s, on whatever adapter QK_DEVICE picks.
//!
//!   cargo bench --no-default-features --bench kernels            # full sizes (a real GPU)
//!   QK_BENCH_SMOKE=1 cargo bench --no-default-features --bench kernels   # tiny sizes, CI
//!
//! QK_BENCH_TYPES=IQ4_XS,Q8_0 limits the mat-vec types, QK_BENCH_NO_MATMUL=1 skips mat-mat.
//! Mat-mat runs the f32 tiled kernel and, where the adapter offers it, the cooperative-matrix one
//! side by side; `auto` names the one prefill uses (the tiled one unless QK_COOP=1).
//! QK_BENCH_MIB sets the mat-vec weight size (default 256 MiB; the H200 target is IQ4_XS and Q8_0
//! mat-vec ≥ 70% of copy bandwidth from 64 MiB up). Timing is wall-clock around one submit of
//! `iters` dependent dispatches, after a warm-up, so per-submit overhead (~0.2 ms) is amortised.

use std::time::Instant;

use qk::gguf::GgmlType;
use qk::gpu::{Gpu, GpuBuffer};
use qk::ops::matmul::{Columns, MatmulKernel, coop_accumulator, matmul_kernel, matmul_with, matvec};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// Random blocks with finite f16 scales (the values do not matter for speed, NaNs might).
fn weights(ty: GgmlType, n: usize, rng: &mut Rng) -> Vec<u8> {
    let bytes = ty.bytes_for(n as u64).expect("whole blocks") as usize;
    let mut b: Vec<u8> = (0..bytes).map(|_| rng.next() as u8).collect();
    let small = half::f16::from_f32(0.01).to_le_bytes();
    match ty {
        GgmlType::F32 => b
            .chunks_exact_mut(4)
            .for_each(|c| c.copy_from_slice(&0.5f32.to_le_bytes())),
        GgmlType::F16 | GgmlType::BF16 => b.chunks_exact_mut(2).for_each(|c| c.copy_from_slice(&small)),
        _ => b.chunks_exact_mut(ty.block_bytes()).for_each(|blk| {
            let at = if ty == GgmlType::Q6K { 208 } else { 0 };
            blk[at..at + 2].copy_from_slice(&small);
            if matches!(ty, GgmlType::Q4K | GgmlType::Q5K) {
                blk[2..4].copy_from_slice(&small);
            }
        }),
    }
    b
}

fn smoke() -> bool {
    std::env::var("QK_BENCH_SMOKE").is_ok_and(|v| v == "1")
}

/// Seconds per iteration: the best of 4 submits of `iters` recorded iterations (the first warms
/// pipelines and caches), so clock ramps and host jitter do not count; 1 timed submit when smoke.
fn time_submit(gpu: &Gpu, iters: u32, mut record: impl FnMut(&mut qk::gpu::Recorder<'_>)) -> f64 {
    let mut best = f64::INFINITY;
    let rounds = if smoke() { 2 } else { 5 };
    for round in 0..rounds {
        let mut rec = gpu.recorder();
        for _ in 0..iters {
            record(&mut rec);
        }
        let start = Instant::now();
        rec.submit().expect("submit");
        gpu.wait().expect("wait");
        if round > 0 {
            best = best.min(start.elapsed().as_secs_f64() / f64::from(iters));
        }
    }
    best
}

fn copy_bandwidth(gpu: &Gpu, bytes: u64, iters: u32) -> f64 {
    let a = gpu.buffer_zeroed("copy_src", bytes).expect("buffer");
    let b = gpu.buffer_zeroed("copy_dst", bytes).expect("buffer");
    let t = time_submit(gpu, iters, |rec| {
        qk::gpu::example::copy_kernel(gpu, rec, &a, &b, bytes).expect("copy")
    });
    // A copy reads and writes every byte.
    2.0 * bytes as f64 / t / 1e9
}

fn main() {
    let smoke = smoke();
    let gpu = match Gpu::from_env() {
        Ok(g) => g,
        Err(e) => {
            eprintln!("kernels bench: no device ({e}); nothing to measure");
            return;
        }
    };
    println!(
        "adapter: {} ({}, {}), subgroups {}",
        gpu.adapter.name, gpu.adapter.backend, gpu.adapter.device_type, gpu.caps.subgroups
    );
    let mib: u64 = std::env::var("QK_BENCH_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let (target_bytes, iters) = if smoke { (256u64 << 10, 1) } else { (mib << 20, 20) };

    // One binding's worth at most, a multiple of 16.
    let copy_bytes = target_bytes.min(gpu.caps.max_binding_size) / 16 * 16;
    let copy_gbs = copy_bandwidth(&gpu, copy_bytes, iters);
    println!(
        "copy      {:>8.1} MiB  {copy_gbs:>9.1} GB/s (read+write, copy kernel)",
        copy_bytes as f64 / 1048576.0
    );

    let k: usize = if smoke { 256 } else { 4096 };
    let mut rng = Rng(0x5eed);
    for ty in [
        GgmlType::IQ4XS,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::IQ4NL,
        GgmlType::Q4_0,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::F32,
    ] {
        // QK_BENCH_TYPES=IQ4_XS,Q8_0 restricts the mat-vec list (tuning runs).
        if let Ok(only) = std::env::var("QK_BENCH_TYPES")
            && !only.split(',').any(|t| t.eq_ignore_ascii_case(ty.name()))
        {
            continue;
        }
        let row_bytes = ty.bytes_for(k as u64).expect("k");
        let m = (target_bytes / row_bytes).max(64) as usize;
        let w = gpu
            .upload_weight(
                "bench_w",
                ty,
                k as u64,
                m as u64,
                1,
                &weights(ty, m * k, &mut rng),
            )
            .expect("upload");
        let x = gpu.buffer_from_f32("x", &vec![0.5; k * 8]).expect("x");
        let y = gpu.buffer_zeroed("y", (m * 8 * 4) as u64).expect("y");
        let mut line = format!(
            "matvec {:<7} {:>7.1} MiB",
            ty.name(),
            (m as u64 * row_bytes) as f64 / 1048576.0
        );
        for cols in [1u32, 4, 8] {
            let t = time_submit(&gpu, iters, |rec| {
                matvec(
                    &gpu,
                    rec,
                    &w,
                    Columns::packed(&x, k as u32),
                    Columns::packed(&y, m as u32),
                    cols,
                )
                .expect("matvec")
            });
            let gbs = (m as u64 * row_bytes) as f64 / t / 1e9;
            line += &format!(
                "  n={cols}: {gbs:>7.1} GB/s ({:>4.0}% of copy, {:>7.1} µs)",
                100.0 * gbs / copy_gbs,
                t * 1e6
            );
        }
        println!("{line}");
    }

    if std::env::var("QK_BENCH_NO_MATMUL").is_ok_and(|v| v == "1") {
        return;
    }
    let (mm, mk, mn) = if smoke {
        (128usize, 256usize, 96u32)
    } else {
        (4096, 4096, 512)
    };
    for ty in [GgmlType::IQ4XS, GgmlType::Q8_0, GgmlType::F16] {
        let w = gpu
            .upload_weight(
                "bench_mm",
                ty,
                mk as u64,
                mm as u64,
                1,
                &weights(ty, mm * mk, &mut rng),
            )
            .expect("upload");
        let x: GpuBuffer = gpu.buffer_from_f32("x", &vec![0.5; mk * mn as usize]).expect("x");
        let y = gpu.buffer_zeroed("y", (mm * mn as usize * 4) as u64).expect("y");
        let flops = 2.0 * mm as f64 * mk as f64 * f64::from(mn);
        let mut line = format!("matmul {:<7} {mm}x{mk}x{mn}:", ty.name());
        let mut kernels = vec![MatmulKernel::Tiled];
        if coop_accumulator(&gpu).is_some() {
            kernels.push(MatmulKernel::Coop);
        }
        for kernel in kernels {
            let t = time_submit(&gpu, iters.min(5), |rec| {
                matmul_with(
                    &gpu,
                    rec,
                    &w,
                    Columns::packed(&x, mk as u32),
                    Columns::packed(&y, mm as u32),
                    mn,
                    kernel,
                )
                .expect("matmul")
            });
            line += &format!(
                "  {kernel:?}: {:>8.1} GFLOP/s ({:.3} ms)",
                flops / t / 1e9,
                t * 1e3
            );
        }
        println!("{line}  auto={:?}", matmul_kernel(&gpu, mn));
    }
    let c = gpu.counters();
    println!(
        "counters: {} pipelines, {} bind groups, {} buffers, {} submits",
        c.pipelines, c.bind_groups, c.buffers, c.submits
    );
}
