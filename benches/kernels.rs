//! Kernel micro-benchmark: device-to-device copy bandwidth (the baseline), mat-vec GB/s of weight
//! bytes per type, mat-mat GFLOP/s, the prefill kernels at the Qwen3-Next-80B shape (chunked
//! DeltaNet, grouped MoE mat-mat), and attention (decode GB/s of K/V per cache type and depth,
//! prepare, prefill TFLOP/s), on whatever adapter QK_DEVICE picks.
//!
//!   cargo bench --no-default-features --bench kernels            # full sizes (a real GPU)
//!   QK_BENCH_SMOKE=1 cargo bench --no-default-features --bench kernels   # tiny sizes, CI
//!
//! QK_BENCH_TYPES=IQ4_XS,Q8_0 limits the mat-vec types, QK_BENCH_NO_MATMUL=1 skips mat-mat,
//! QK_BENCH_ONLY_PREFILL=1 runs only the prefill cases (DeltaNet and MoE), QK_BENCH_ONLY_DECODE=1
//! only the decode MoE layer (expert mat-vecs per launch shape), QK_BENCH_ONLY_ATTENTION=1
//! only attention, QK_BENCH_ONLY_MOE=1 / QK_BENCH_ONLY_DELTANET=1 only the prefill MoE / chunked
//! DeltaNet (with QK_BENCH_NO_ATTENTION=1), QK_BENCH_NO_ATTENTION=1 skips attention,
//! QK_BENCH_ONLY_ENGINE_PROJECTIONS=1 runs only the decode GDN projections as the engine records
//! them (with QK_BENCH_NO_ATTENTION=1), QK_BENCH_ONLY_ATTENTION_DECODE=1 only decode attention per
//! kernel and per walk of the keys, QK_BENCH_ONLY_MOE_COLD=1 only the decode MoE layer with its
//! experts' weights cold and warm, QK_BENCH_ONLY_GDN_STEP=1 only the gated DeltaNet decode step,
//! QK_BENCH_ONLY_NORM_PROJECTIONS=1 only the decode step's dense products per launch shape and
//! column groups (with QK_BENCH_NO_ATTENTION=1),
//! QK_BENCH_ONLY_MATVEC=1 only the large mat-vecs per type (no mat-mat), QK_BENCH_ONLY_HOST=1 only
//! the host's share of a decode-sized submit per count of buffers it references, a step's input
//! writes as one queue write or three, and a split's
//! hand-off through the host with a blocking and a spinning wait, and armed (Vulkan: submitted
//! ahead, waiting on a timeline semaphore the host signals), and the submit-to-results floor of
//! nothing, one dispatch, and one dispatch with its readback. QK_BENCH_ONLY_READ_FLOOR=1 only the
//! read floor: plain loads of 1–48 MiB per launch shape, and empty grids (what any decode kernel
//! reading that many bytes in one dispatch could take).
//! QK_MATVEC_NR / QK_MATVEC_WG / QK_MATVEC_UNROLL give the mat-vec another launch shape (tuning
//! runs). QK_CHECKED_SHADERS=1 compiles every kernel with wgpu's runtime checks
//! (GpuOptions::checked_shaders): run the bench with and without it to compare.
//! Mat-mat runs the f32 tiled kernel and, where the adapter offers them, the cooperative-matrix
//! tiles side by side; `fast` names the kernel a default (not precise) engine picks.
//! QK_BENCH_MIB sets the mat-vec weight size (default 256 MiB; the H200 target is IQ4_XS and Q8_0
//! mat-vec ≥ 70% of copy bandwidth from 64 MiB up). Timing is wall-clock around one submit of
//! `iters` dependent dispatches, after a warm-up, so per-submit overhead (~0.2 ms) is amortised;
//! the prefill cases add one profiled submit that times each kernel on the GPU.

use std::time::{Duration, Instant};

use qk::gguf::GgmlType;
use qk::gpu::armed::ArmedInputs;
use qk::gpu::{Gpu, GpuBuffer, Recorder, WeightTensor};
use qk::ops::attention::{
    self, AttnRows, AttnShape, CoreArgs, DecodeTuning, GateLayout, KvGroup, KvType, OutLayout, PrefillKernel,
    PrepareArgs, ProjLayout, reference,
};
use qk::ops::deltanet::{self, DeltaArgs, DeltaParams, HeadPairing};
use qk::ops::matmul::{
    Columns, CoopTile, ExpertGroups, ExpertIds, GroupShape, Iq4Lookup, MatmulKernel, MatvecFusion,
    MatvecInput, MatvecOutput, MatvecShape, MoeInput, MoeRoute, Precision, coop_accumulator,
    expert_call_shape, expert_shape, group_experts, k_splits, matmul_id, matmul_kernel, matmul_split,
    matmul_with, matvec, matvec_coop, matvec_coop_fits, matvec_id, matvec_id_routed, matvec_id_sum,
    matvec_id_with, matvec_shaped, route_lanes,
};

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

/// A dense `rows` × `k` matrix of random blocks of `ty` ([`weights`]) on the GPU.
fn random_matrix(gpu: &Gpu, label: &str, ty: GgmlType, k: u64, rows: u64, rng: &mut Rng) -> WeightTensor {
    gpu.upload_weight(label, ty, k, rows, 1, &weights(ty, (rows * k) as usize, rng))
        .expect("upload")
}

/// A buffer of `len` floats, each `value`.
fn filled(gpu: &Gpu, name: &str, value: f32, len: usize) -> GpuBuffer {
    gpu.buffer_from_f32(name, &vec![value; len]).expect("buffer")
}

/// The `num / den` quantile of `values` (the median at 1 / 2: the upper middle of an even count).
fn quantile(values: impl Iterator<Item = f64>, num: usize, den: usize) -> f64 {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    v[v.len() * num / den]
}

fn flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1")
}

fn smoke() -> bool {
    flag("QK_BENCH_SMOKE")
}

/// The mat-vec launch shape from QK_MATVEC_NR / _WG / _UNROLL over the type's default, if any is set.
fn matvec_shape_from_env(ty: GgmlType, ncols: u32) -> Option<MatvecShape> {
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u32>().ok());
    let (nr, wg, unroll) = (env("QK_MATVEC_NR"), env("QK_MATVEC_WG"), env("QK_MATVEC_UNROLL"));
    if nr.is_none() && wg.is_none() && unroll.is_none() {
        return None;
    }
    let d = MatvecShape::default_for(ty, ncols);
    Some(MatvecShape {
        rows: nr.unwrap_or(d.rows),
        wg: wg.unwrap_or(d.wg),
        unroll: unroll.unwrap_or(d.unroll),
        ..d
    })
}

/// GPU time of each kernel of one profiled submit of `record` (µs, in recording order, dispatches
/// of one pipeline summed); empty without timestamp queries.
fn kernel_times(gpu: &Gpu, record: impl FnOnce(&mut Recorder<'_>)) -> Vec<(String, f64)> {
    let mut rec = gpu.profiling_recorder();
    rec.op("bench", None, 0);
    record(&mut rec);
    let (_, finished) = rec.finish_and_read_timed().expect("profiled submit");
    let mut out: Vec<(String, f64)> = Vec::new();
    for d in finished.profile.map(|p| p.dispatches).unwrap_or_default() {
        let Some(ns) = d.gpu_ns else { return Vec::new() };
        match out.iter_mut().find(|(k, _)| *k == d.kernel) {
            Some((_, us)) => *us += ns / 1e3,
            None => out.push((d.kernel, ns / 1e3)),
        }
    }
    out
}

fn print_kernel_times(times: &[(String, f64)]) {
    for (k, us) in times {
        println!("    {us:>10.1} µs  {k}");
    }
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
        // Encoded before the clock starts: wgpu's per-dispatch work at the end of a pass is host
        // time (the engine overlaps it with the GPU), not the kernels' (until 2026-12-02 it was
        // inside the timed span).
        let encoded = rec.finish().expect("encode");
        let start = Instant::now();
        encoded.submit(gpu).wait(gpu).expect("wait");
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
        "adapter: {} ({}, {}), subgroups {}, unchecked shaders {}",
        gpu.adapter.name,
        gpu.adapter.backend,
        gpu.adapter.device_type,
        gpu.caps.subgroups,
        gpu.unchecked_shaders
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

    if flag("QK_BENCH_ONLY_READ_FLOOR") {
        read_floor(&gpu);
        return;
    }
    if flag("QK_BENCH_ONLY_GDN_STEP") {
        gdn_step_decode(&gpu);
        return;
    }
    if flag("QK_BENCH_ONLY_MOE_COLD") {
        moe_decode_cold(&gpu, &mut Rng(0x5eed));
        return;
    }
    if flag("QK_BENCH_ONLY_ATTENTION_DECODE") {
        attention_decode_sweep(&gpu);
        return;
    }
    if flag("QK_BENCH_ONLY_MATVEC") {
        matrix_kernels(&gpu, &mut Rng(0x5eed), target_bytes, iters, copy_gbs);
        return;
    }
    if flag("QK_BENCH_ONLY_HOST") {
        host_step_cost(&gpu);
        step_input_writes(&gpu);
        handoff_round_trip(&gpu);
        armed_handoff(&gpu);
        submit_floor(&gpu);
        return;
    }
    if !flag("QK_BENCH_NO_ATTENTION") {
        attention_bench(&gpu, copy_gbs, smoke);
    }
    if flag("QK_BENCH_ONLY_ATTENTION") {
        return;
    }
    let mut rng = Rng(0x5eed);
    if flag("QK_BENCH_ONLY_MOE") {
        moe_prefill(&gpu, &mut rng);
        return;
    }
    if flag("QK_BENCH_ONLY_DELTANET") {
        deltanet_prefill(&gpu, &mut rng);
        return;
    }
    if flag("QK_BENCH_ONLY_ENGINE_PROJECTIONS") {
        engine_projections_decode(&gpu, &mut rng);
        return;
    }
    if flag("QK_BENCH_ONLY_NORM_PROJECTIONS") {
        norm_projection_decode(&gpu, &mut rng);
        return;
    }
    if !flag("QK_BENCH_ONLY_PREFILL") {
        dispatch_floor(&gpu);
        host_step_cost(&gpu);
        step_input_writes(&gpu);
        handoff_round_trip(&gpu);
        moe_decode(&gpu, &mut rng);
        norm_projection_decode(&gpu, &mut rng);
        engine_projections_decode(&gpu, &mut rng);
        coop_decode(&gpu, &mut rng);
        gdn_step_decode(&gpu);
    }
    if flag("QK_BENCH_ONLY_DECODE") {
        return;
    }
    if !flag("QK_BENCH_ONLY_PREFILL") {
        matrix_kernels(&gpu, &mut rng, target_bytes, iters, copy_gbs);
    }
    projection_prefill(&gpu, &mut rng);
    deltanet_prefill(&gpu, &mut rng);
    moe_prefill(&gpu, &mut rng);
    let c = gpu.counters();
    println!(
        "counters: {} pipelines, {} bind groups, {} buffers, {} submits",
        c.pipelines, c.bind_groups, c.buffers, c.submits
    );
}

/// Mat-vec GB/s per type and dense mat-mat GFLOP/s per kernel.
fn matrix_kernels(gpu: &Gpu, rng: &mut Rng, target_bytes: u64, iters: u32, copy_gbs: f64) {
    let smoke = smoke();
    let k: usize = if smoke { 256 } else { 4096 };
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
        let w = random_matrix(gpu, "bench_w", ty, k as u64, m as u64, rng);
        let x = filled(gpu, "x", 0.5, k * 8);
        let y = gpu.buffer_zeroed("y", (m * 8 * 4) as u64).expect("y");
        let mut line = format!(
            "matvec {:<7} {:>7.1} MiB",
            ty.name(),
            (m as u64 * row_bytes) as f64 / 1048576.0
        );
        // Wall-clock timing: without the hold, a type's figures moved 2× with its place in the list
        // (Q8_0 1.3 vs 2.5 TB/s in two runs of one kernel, H200 2026-12-03).
        hold_clocks(gpu);
        for cols in [1u32, 4, 8] {
            let shape = matvec_shape_from_env(ty, cols);
            let t = time_submit(gpu, iters, |rec| {
                matvec_shaped(
                    gpu,
                    rec,
                    &w,
                    None,
                    Columns::packed(&x, k as u32),
                    Columns::packed(&y, m as u32),
                    cols,
                    &MatvecFusion::default(),
                    shape,
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

    if flag("QK_BENCH_NO_MATMUL") || flag("QK_BENCH_ONLY_MATVEC") {
        return;
    }
    let (mm, mk, mn) = if smoke {
        (128usize, 256usize, 96u32)
    } else {
        (4096, 4096, 512)
    };
    for ty in [GgmlType::IQ4XS, GgmlType::Q8_0, GgmlType::F16] {
        let w = random_matrix(gpu, "bench_mm", ty, mk as u64, mm as u64, rng);
        let x = filled(gpu, "x", 0.5, mk * mn as usize);
        let y = gpu.buffer_zeroed("y", (mm * mn as usize * 4) as u64).expect("y");
        let flops = 2.0 * mm as f64 * mk as f64 * f64::from(mn);
        let mut line = format!("matmul {:<7} {mm}x{mk}x{mn}:", ty.name());
        let mut kernels = vec![MatmulKernel::Tiled];
        for tile in CoopTile::DENSE {
            if coop_accumulator(gpu, tile).is_some() {
                kernels.push(MatmulKernel::Coop(tile));
            }
        }
        for kernel in kernels {
            let t = time_submit(gpu, iters.min(5), |rec| {
                matmul_with(
                    gpu,
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
                "  {}: {:>8.1} GFLOP/s ({:.3} ms)",
                kernel_name(kernel),
                flops / t / 1e9,
                t * 1e3
            );
        }
        let fast = matmul_kernel(gpu, Precision::Fast, ty, mm as u64, mk as u64, mn);
        println!("{line}  fast={}", kernel_name(fast));
    }
}

/// The name a mat-mat kernel goes by in the tables (a K step other than 32 is named).
fn kernel_name(kernel: MatmulKernel) -> String {
    match kernel {
        MatmulKernel::Tiled => "tiled".to_string(),
        MatmulKernel::Coop(t) if t.k_step != 32 => format!("coop{}x{}k{}", t.rows, t.cols, t.k_step),
        MatmulKernel::Coop(t) => format!("coop{}x{}", t.rows, t.cols),
    }
}

/// The cooperative tiles this adapter runs, each with K steps 32 and 64.
fn coop_kernels(gpu: &Gpu, tiles: &[CoopTile]) -> Vec<MatmulKernel> {
    let mut out = Vec::new();
    for &tile in tiles {
        for k_step in [32, 64] {
            let t = tile.with_k_step(k_step);
            if coop_accumulator(gpu, t).is_some() {
                out.push(MatmulKernel::Coop(t));
            }
        }
    }
    out
}

/// The dense products of one Qwen3-Next-80B layer (rows × K: the F32 router + shared gate and
/// β/α, the IQ4_XS DeltaNet qkv, z and out, the shared expert's gate+up and down) over a 64- and a
/// 512-token piece: per kernel (tiled f32, each cooperative tile with K steps 32 and 64) unsplit
/// and split over K as the engine does (`k_splits`), and which kernel and split a fast engine
/// picks. µs per product, TFLOP/s, GB/s of weights read.
fn projection_prefill(gpu: &Gpu, rng: &mut Rng) {
    let pieces: &[u32] = if smoke() { &[96] } else { &[64, 512] };
    let shapes: &[(&str, GgmlType, usize, usize)] = if smoke() {
        &[
            ("small", GgmlType::IQ4XS, 256, 256),
            ("small.f32", GgmlType::F32, 64, 512),
        ]
    } else {
        &[
            ("router+gate", GgmlType::F32, 513, 2048),
            ("dn.ba", GgmlType::F32, 64, 2048),
            ("dn.qkv", GgmlType::IQ4XS, 8192, 2048),
            ("dn.z", GgmlType::IQ4XS, 4096, 2048),
            ("dn.out", GgmlType::IQ4XS, 2048, 4096),
            ("shexp.gate_up", GgmlType::IQ4XS, 1024, 2048),
            ("shexp.down", GgmlType::IQ4XS, 2048, 512),
        ]
    };
    let max_cols = *pieces.iter().max().expect("a piece") as usize;
    for &(name, ty, rows, k) in shapes {
        let w = random_matrix(gpu, "bench_proj", ty, k as u64, rows as u64, rng);
        let x = filled(gpu, "x", 0.5, k * max_cols);
        let y = gpu.buffer_zeroed("y", (rows * max_cols * 4) as u64).expect("y");
        let splits = k_splits(rows as u64, k as u64);
        let part = gpu
            .buffer_zeroed("partials", u64::from(splits) * (rows * max_cols * 4) as u64)
            .expect("partials");
        let mut kernels = vec![MatmulKernel::Tiled];
        kernels.extend(coop_kernels(gpu, &CoopTile::DENSE));
        for &ncols in pieces {
            let flops = 2.0 * rows as f64 * k as f64 * f64::from(ncols);
            let bytes = (w.rows * w.row_bytes) as f64;
            println!(
                "prefill {name:<14} {rows}x{k}x{ncols} {} (engine splits K {splits}×):",
                ty.name()
            );
            for &kernel in &kernels {
                let mut line = format!("    {:<14}", kernel_name(kernel));
                let mut runs = vec![1];
                if splits > 1 {
                    runs.push(splits);
                }
                for s in runs {
                    // 20 products per submit: the small ones take tens of µs, a submit ~200.
                    let t = time_submit(gpu, if smoke() { 1 } else { 20 }, |rec| {
                        let (xc, yc) = (Columns::packed(&x, k as u32), Columns::packed(&y, rows as u32));
                        matmul_split(gpu, rec, &w, xc, yc, ncols, kernel, s, Some(&part)).expect("matmul")
                    });
                    line += &format!(
                        "  split {s:>2}: {:>8.1} µs {:>6.2} TFLOP/s {:>7.1} GB/s",
                        t * 1e6,
                        flops / t / 1e12,
                        bytes / t / 1e9
                    );
                }
                println!("{line}");
            }
            let fast = matmul_kernel(gpu, Precision::Fast, ty, rows as u64, k as u64, ncols);
            let precise = matmul_kernel(gpu, Precision::Precise, ty, rows as u64, k as u64, ncols);
            println!(
                "    engine: fast={} precise={} split {splits}",
                kernel_name(fast),
                kernel_name(precise)
            );
        }
    }
}

/// Chunked DeltaNet prefill at the Qwen3-Next-80B shape (16 k-heads, 32 v-heads, dk = dv = 128):
/// µs per call and per 64-token chunk, tokens/s of one layer, and the prep and state kernels'
/// own GPU times.
fn deltanet_prefill(gpu: &Gpu, rng: &mut Rng) {
    let (nk, nv, dk, dv) = if smoke() {
        (2u32, 4u32, 32u32, 32u32)
    } else {
        (16, 32, 128, 128)
    };
    let lengths: &[u32] = if smoke() { &[128] } else { &[512, 4096] };
    let mut f = |n: usize, scale: f32| -> Vec<f32> {
        (0..n)
            .map(|_| ((rng.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale)
            .collect()
    };
    for &tokens in lengths {
        let stride = 2 * nk * dk + nv * dv;
        let p = DeltaParams {
            tokens,
            k_heads: nk,
            v_heads: nv,
            dk,
            dv,
            pairing: HeadPairing::Grouped as u32,
            qkv_token_stride: stride,
            k_offset: nk * dk,
            v_offset: 2 * nk * dk,
            ba_token_stride: 2 * nv,
            ba_group: nv / nk,
            ba_group_stride: 2 * (nv / nk),
            alpha_offset: nv / nk,
            out_token_stride: nv * dv,
            eps: 1e-6,
            q_scale: 1.0 / (dk as f32).sqrt(),
            ..bytemuck::Zeroable::zeroed()
        };
        let up = |name: &str, v: &[f32]| gpu.buffer_from_f32(name, v).expect("upload");
        let qkv = up("qkv", &f((tokens * stride) as usize, 1.0));
        let ba = up("ba", &f((tokens * 2 * nv) as usize, 2.0));
        let ssm_a: Vec<f32> = f(nv as usize, 1.0).iter().map(|x| -(x * 1.5).exp()).collect();
        let ssm_a = up("ssm_a", &ssm_a);
        let dt_bias = up("dt_bias", &f(nv as usize, 1.0));
        let state = up("state", &f((nv * dk * dv) as usize, 0.5));
        let out = gpu
            .buffer_zeroed("out", u64::from(tokens * nv * dv) * 4)
            .expect("out");
        let scratch = gpu
            .buffer_zeroed("dn_scratch", p.scratch_len(tokens) * 4)
            .expect("scratch");
        let args = DeltaArgs {
            qkv: &qkv,
            ba: &ba,
            ssm_a: &ssm_a,
            dt_bias: &dt_bias,
            state: &state,
            out: &out,
            scratch: Some(&scratch),
        };
        for loads in [deltanet::StateLoads::Scalar, deltanet::StateLoads::Vec4] {
            let record = |rec: &mut Recorder<'_>| {
                deltanet::record_chunked_with(gpu, rec, &p, &args, loads).expect("deltanet")
            };
            let t = time_submit(gpu, 5, record);
            let chunks = tokens.div_ceil(deltanet::CHUNK);
            let engine = if loads == deltanet::STATE_LOADS {
                ", engine"
            } else {
                ""
            };
            println!(
                "deltanet chunked {tokens} tokens ({nv} v-heads, {nk} k-heads, dk {dk}, dv {dv}), state \
                 loads {loads:?}{engine}: {:>9.1} µs per layer, {:>7.2} µs per chunk, {:>10.0} tokens/s per layer",
                t * 1e6,
                t * 1e6 / f64::from(chunks),
                f64::from(tokens) / t
            );
            print_kernel_times(&kernel_times(gpu, record));
        }
    }
}

/// A layer's expert stacks at the given shape: gate ‖ up (2·ff rows × n_embd) and down (n_embd
/// rows × ff), random weights of `ty`.
fn expert_stacks(
    gpu: &Gpu,
    rng: &mut Rng,
    ty: GgmlType,
    experts: u32,
    ff: u32,
    n_embd: u32,
) -> (qk::gpu::WeightTensor, qk::gpu::WeightTensor) {
    let mut stack = |name: &str, k: u32, rows: u32| {
        gpu.upload_weight(
            name,
            ty,
            u64::from(k),
            u64::from(rows),
            u64::from(experts),
            &weights(ty, (experts * rows * k) as usize, rng),
        )
        .expect("upload")
    };
    let gate_up = stack("bench_gate_up_exps", n_embd, 2 * ff);
    let down = stack("bench_down_exps", ff, n_embd);
    (gate_up, down)
}

/// `k` distinct uniform experts of `experts` per token (a router's top-k), then `last` if given.
fn random_picks(rng: &mut Rng, tokens: u32, k: u32, experts: u32, last: Option<u32>) -> Vec<u32> {
    let mut ids = Vec::new();
    for _ in 0..tokens {
        let mut chosen: Vec<u32> = Vec::new();
        while chosen.len() < k as usize {
            let e = (rng.next() % u64::from(experts)) as u32;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        chosen.extend(last);
        ids.extend(chosen);
    }
    ids
}

/// The decode step's fused dense products at the Qwen3-Next-80B shape, for 1 and 8 columns (the GDN
/// output projection for 1, 2, 4 and 8), per launch shape (every workgroup computes its columns'
/// norms, so rows per workgroup trade those re-reads against parallelism): the DeltaNet layer's
/// q ‖ k ‖ v ‖ z (12,288 rows × 2048, IQ4_XS), attention's q ‖ k ‖ v (9216 × 2048), the MoE
/// router with the shared expert's gate (513 × 2048, F32), and the two output projections with
/// the residual added (2048 × 4096 each: the GDN's 32 heads of 128 read through the gated norm's
/// head RMS, attention's 16 heads of 256 plain). Rows and steps per iteration may follow the
/// column count (a row's sum depends on the width alone), so the question per width is the best
/// shape at each count.
fn norm_projection_decode(gpu: &Gpu, rng: &mut Rng) {
    // (rows, width, steps per iteration) per workgroup, and the same with the columns in 2 and in 4
    // groups (at 8 columns, 4 and 2 per workgroup).
    let shapes =
        |list: &[(u32, u32, u32)]| -> Vec<Option<MatvecShape>> {
            let mut all = Vec::new();
            for groups in [1, 2, 4] {
                all.extend(list.iter().map(|&(rows, wg, unroll)| {
                    Some(MatvecShape::new(rows, wg, unroll).with_col_groups(groups))
                }));
            }
            all
        };
    #[rustfmt::skip]
    let qkvz = shapes(&[(4, 64, 1), (4, 64, 2), (8, 64, 1), (8, 64, 2), (8, 128, 1), (8, 32, 2), (16, 64, 1), (16, 32, 1), (16, 32, 2), (16, 128, 1)]);
    #[rustfmt::skip]
    let router = shapes(&[(1, 64, 1), (1, 128, 1), (1, 256, 1), (2, 64, 1), (2, 128, 1), (2, 256, 1), (4, 64, 1), (4, 128, 1), (8, 32, 1), (8, 64, 1)]);
    // The GDN output projection's width is fixed by its K (256 at K = 4096); rows per workgroup
    // are the question.
    #[rustfmt::skip]
    let out = shapes(&[(2, 256, 1), (4, 256, 1), (8, 256, 1), (16, 256, 1)]);
    let small = smoke();
    let rms = |norm| MatvecInput::Rms {
        weight: norm,
        eps: 1e-6,
        store: None,
    };
    let (rows, k) = if small { (96u32, 256u32) } else { (12288, 2048) };
    let norm = filled(gpu, "norm_w", 1.0, k as usize);
    let case = |label, ty, rows, k, cols| ProjectionCase {
        label,
        ty,
        rows,
        k,
        cols,
    };
    let ends: &[u32] = &[1, 8];
    projection_shapes(
        gpu,
        rng,
        case("norm+qkvz", GgmlType::IQ4XS, rows, k, ends),
        rms(&norm),
        false,
        &qkvz,
    );
    // Attention's q (with its gate) ‖ k ‖ v: 16 heads of 256 twice, 2 kv heads of 256 each.
    let rows = if small { 72u32 } else { 9216 };
    projection_shapes(
        gpu,
        rng,
        case("norm+attn_qkv", GgmlType::IQ4XS, rows, k, ends),
        rms(&norm),
        false,
        &qkvz,
    );
    let (rows, k) = if small { (33u32, 256u32) } else { (513, 2048) };
    projection_shapes(
        gpu,
        rng,
        case("norm+router", GgmlType::F32, rows, k, ends),
        rms(&norm),
        false,
        &router,
    );
    // The GDN output projection: 32 heads of 128 (the gated norm's per-head RMS finished from
    // partial sums of squares, one part per head here) and the residual added.
    let (rows, heads, head_dim) = if small {
        (64u32, 2u32, 128u32)
    } else {
        (2048, 32, 128)
    };
    let sums = filled(gpu, "head_sq", 128.0, (8 * heads) as usize);
    let head_rms = MatvecInput::HeadRms {
        sums: &sums,
        heads,
        head_dim,
        parts: 1,
        offset: 0,
        stride: heads,
        eps: 1e-6,
    };
    let k = heads * head_dim;
    // Every column count up to 8: where more rows per workgroup start to pay.
    projection_shapes(
        gpu,
        rng,
        case("head_rms+out+add", GgmlType::IQ4XS, rows, k, &[1, 2, 4, 8]),
        head_rms,
        true,
        &out,
    );
    // Attention's output projection (16 heads of 256 in, the residual added): the same K, plain
    // input.
    projection_shapes(
        gpu,
        rng,
        case("attn_out+add", GgmlType::IQ4XS, rows, k, ends),
        MatvecInput::Plain,
        true,
        &out,
    );
}

/// A decode-shaped dense product of the kernel bench: its label, type, rows × K and the column
/// counts to time.
struct ProjectionCase {
    label: &'static str,
    ty: GgmlType,
    rows: u32,
    k: u32,
    cols: &'static [u32],
}

/// Every shape (and the default) of one fused dense product at the case's column counts, the input
/// stage `input`, the residual added when `add`.
fn projection_shapes(
    gpu: &Gpu,
    rng: &mut Rng,
    case: ProjectionCase,
    input: MatvecInput<'_>,
    add: bool,
    shapes: &[Option<MatvecShape>],
) {
    let ProjectionCase {
        label,
        ty,
        rows,
        k,
        cols: col_counts,
    } = case;
    let w = random_matrix(gpu, label, ty, u64::from(k), u64::from(rows), rng);
    let iters = if smoke() { 1 } else { 20 };
    let bytes = (w.rows * w.row_bytes) as f64;
    for &cols in col_counts {
        hold_clocks(gpu);
        let x = filled(gpu, "x", 0.5, (cols * k) as usize);
        let y = gpu.buffer_zeroed("y", u64::from(cols * rows) * 4).expect("y");
        let residual = filled(gpu, "residual", 0.25, (cols * rows) as usize);
        let fusion = MatvecFusion {
            input,
            output: if add {
                MatvecOutput::AddTo { residual: &residual }
            } else {
                MatvecOutput::Store
            },
        };
        // Column groups that do not divide this count would repeat the ungrouped shape.
        let cases: Vec<&Option<MatvecShape>> = std::iter::once(&None)
            .chain(
                shapes
                    .iter()
                    .filter(|s| s.is_none_or(|s| s.groups_for(cols) == s.col_groups)),
            )
            .collect();
        let best = best_of_two_passes(gpu, cases.len(), 0.0, 0.25, |i| {
            time_submit(gpu, iters, |rec| {
                let (xc, yc) = (Columns::packed(&x, k), Columns::packed(&y, rows));
                matvec_shaped(gpu, rec, &w, None, xc, yc, cols, &fusion, *cases[i]).expect("matvec");
            })
        });
        for (s, t) in cases.into_iter().zip(best) {
            let name = match s {
                None => "default".to_string(),
                Some(s) => shape_name(*s),
            };
            println!(
                "{label} decode {cols} column(s) ({rows}x{k} {}) {name:<10} {:>8.1} µs  {:>7.1} GB/s",
                ty.name(),
                t * 1e6,
                bytes / t / 1e9
            );
        }
    }
}

/// The decode step's two GDN projections as the engine records them, beside their bare kernel-bench
/// cases: the q‖k‖v‖z with its conv epilogue (8192 conv channels, 4 taps, each column its own
/// slot's state) and the 64 F32 beta/alpha rows riding in the dispatch, and the output projection
/// with its head RMS finished from 16 partial sums per head (the GDN step's) and the residual
/// added. Each warm (the same weights every iteration, so an H200's 50 MB L2 holds them, as in
/// every other case here) and cold (iterations rotate over copies of the weights ≥ 192 MB in all,
/// as the engine reads a layer's weights once per step). At 8 columns the engine's profile had
/// these dispatches at 1.5–1.8× the bare cases (session 12).
fn engine_projections_decode(gpu: &Gpu, rng: &mut Rng) {
    let small = smoke();
    let (rows, k, channels, extra_rows) = if small {
        (96u32, 256u32, 64u32, 8u32)
    } else {
        (12288, 2048, 8192, 64)
    };
    let (heads, head_dim, parts) = if small {
        (2u32, 128u32, 4u32)
    } else {
        (32, 128, 16)
    };
    let out_rows = if small { 64u32 } else { 2048 };
    let taps = 4u32;
    let max_cols = 8u32;
    let iters = if small { 1 } else { 20 };
    // Copies of a matrix of `bytes` bytes that make ≥ 192 MB (2 in smoke runs).
    let copies_for = |bytes: u64| {
        if small {
            2
        } else {
            (192u64 << 20).div_ceil(bytes).max(2)
        }
    };
    let ty = GgmlType::IQ4XS;
    let dk = heads * head_dim;
    let qkvz_bytes = ty.bytes_for(u64::from(rows * k)).expect("blocks");
    let out_bytes = ty.bytes_for(u64::from(out_rows * dk)).expect("blocks");
    let (mut qkvz, mut ba, mut out) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..copies_for(qkvz_bytes) {
        qkvz.push(random_matrix(gpu, "qkvz", ty, u64::from(k), u64::from(rows), rng));
        ba.push(random_matrix(
            gpu,
            "ba",
            GgmlType::F32,
            u64::from(k),
            u64::from(extra_rows),
            rng,
        ));
    }
    for _ in 0..copies_for(out_bytes) {
        out.push(random_matrix(
            gpu,
            "out",
            ty,
            u64::from(dk),
            u64::from(out_rows),
            rng,
        ));
    }
    let norm = filled(gpu, "norm_w", 1.0, k as usize);
    let conv_w = filled(gpu, "conv_w", 0.25, (channels * taps) as usize);
    let state_stride = (taps - 1) * channels;
    let state = filled(gpu, "conv_state", 0.1, (max_cols * state_stride) as usize);
    let slots = gpu
        .buffer_from_u32("slots", &(0..max_cols).collect::<Vec<_>>())
        .expect("slots");
    let sums = filled(gpu, "head_sq", 8.0, (max_cols * heads * parts) as usize);
    let x = filled(gpu, "x", 0.5, (max_cols * k.max(dk)) as usize);
    let proj_width = rows + extra_rows;
    let y = gpu
        .buffer_zeroed("y", u64::from(max_cols * proj_width) * 4)
        .expect("y");
    let residual = filled(gpu, "residual", 0.25, (max_cols * out_rows) as usize);
    let hidden = gpu
        .buffer_zeroed("hidden", u64::from(max_cols * out_rows) * 4)
        .expect("hidden");
    let qkvz_fusion = MatvecFusion {
        input: MatvecInput::Rms {
            weight: &norm,
            eps: 1e-6,
            store: None,
        },
        output: MatvecOutput::Conv {
            weights: &conv_w,
            state: &state,
            slots: &slots,
            slots_offset: 0,
            channels,
            taps,
            state_stride,
        },
    };
    let out_fusion = MatvecFusion {
        input: MatvecInput::HeadRms {
            sums: &sums,
            heads,
            head_dim,
            parts,
            offset: 0,
            stride: heads * parts,
            eps: 1e-6,
        },
        output: MatvecOutput::AddTo { residual: &residual },
    };
    // (the q‖k‖v‖z rather than the output projection, cold, column groups, each group in the
    // default shape of its columns): warm reads copy 0 every iteration; at 8 columns each also
    // cold in 2 and 4 groups.
    let all_cases = [
        (true, false, 1),
        (true, true, 1),
        (false, false, 1),
        (false, true, 1),
        (true, true, 2),
        (false, true, 2),
        (true, true, 4),
        (false, true, 4),
    ];
    let qkvz_input = qkvz_fusion.input;
    for cols in [1u32, 8] {
        hold_clocks(gpu);
        let cases: Vec<_> = all_cases
            .iter()
            .filter(|c| c.2 == 1 || cols % c.2 == 0 && cols > 1)
            .collect();
        let best = best_of_two_passes(gpu, cases.len(), 0.0, 0.25, |i| {
            let (is_qkvz, cold, groups) = *cases[i];
            let copies = if is_qkvz { qkvz.len() } else { out.len() };
            let (w0, input) = if is_qkvz {
                (&qkvz[0], qkvz_input)
            } else {
                (&out[0], out_fusion.input)
            };
            // Every case names its groups (the default's may be any).
            let shape = Some(
                MatvecShape::for_matrix(w0.ty, w0.rows, w0.cols, cols / groups, &input)
                    .with_col_groups(groups),
            );
            let mut at = 0;
            time_submit(gpu, iters, |rec| {
                let c = if cold { at % copies } else { 0 };
                at += 1;
                if is_qkvz {
                    let (xc, yc) = (Columns::packed(&x, k), Columns::packed(&y, proj_width));
                    matvec_shaped(
                        gpu,
                        rec,
                        &qkvz[c],
                        Some(&ba[c]),
                        xc,
                        yc,
                        cols,
                        &qkvz_fusion,
                        shape,
                    )
                    .expect("q‖k‖v‖z");
                } else {
                    let (xc, yc) = (Columns::packed(&x, dk), Columns::packed(&hidden, out_rows));
                    matvec_shaped(gpu, rec, &out[c], None, xc, yc, cols, &out_fusion, shape).expect("out");
                }
            })
        });
        for (&&(is_qkvz, cold, groups), t) in cases.iter().zip(best) {
            let (what, bytes, copies) = if is_qkvz {
                ("q‖k‖v‖z+conv+beta/alpha", qkvz_bytes, qkvz.len())
            } else {
                ("head_rms(16 parts)+out+add", out_bytes, out.len())
            };
            let (temp, copies) = if cold { ("cold", copies) } else { ("warm", 1) };
            let grouped = if groups > 1 {
                format!(" {groups} groups")
            } else {
                String::new()
            };
            println!(
                "engine decode {cols} column(s) {:<44} {:>8.1} µs  {:>7.1} GB/s  ({copies} weight copies)",
                format!("{what} {temp}{grouped}"),
                t * 1e6,
                bytes as f64 / t / 1e9
            );
        }
    }
    // The same products as the engine's tensor_core_decode_cols records them (cold): the
    // q‖k‖v‖z with its norm and conv on tensor cores and the F32 beta/alpha in a mat-vec of its
    // own (no F32 rows ride in the tensor-core kernel), and the output projection.
    let ba_fusion = MatvecFusion {
        input: qkvz_input,
        output: MatvecOutput::Store,
    };
    for cols in [2u32, 4, 8] {
        if !matvec_coop_fits(gpu, &qkvz[0], cols, &qkvz_fusion) {
            println!("engine decode {cols} column(s) on tensor cores: not on this adapter");
            continue;
        }
        hold_clocks(gpu);
        for is_qkvz in [true, false] {
            let copies = if is_qkvz { qkvz.len() } else { out.len() };
            let mut at = 0;
            let t = time_submit(gpu, iters, |rec| {
                let c = at % copies;
                at += 1;
                if is_qkvz {
                    let (xc, yc) = (Columns::packed(&x, k), Columns::packed(&y, proj_width));
                    matvec_coop(gpu, rec, &qkvz[c], xc, yc, cols, &qkvz_fusion).expect("q‖k‖v‖z");
                    let ya = Columns {
                        offset: rows,
                        ..Columns::packed(&y, proj_width)
                    };
                    matvec_shaped(gpu, rec, &ba[c], None, xc, ya, cols, &ba_fusion, None)
                        .expect("beta/alpha");
                } else {
                    let (xc, yc) = (Columns::packed(&x, dk), Columns::packed(&hidden, out_rows));
                    matvec_coop(gpu, rec, &out[c], xc, yc, cols, &out_fusion).expect("out");
                }
            });
            let (what, bytes) = if is_qkvz {
                ("tensor cores q‖k‖v‖z+conv, beta/alpha apart", qkvz_bytes)
            } else {
                ("tensor cores head_rms(16 parts)+out+add", out_bytes)
            };
            println!(
                "engine decode {cols} column(s) {:<44} {:>8.1} µs  {:>7.1} GB/s  ({copies} weight copies)",
                format!("{what} cold"),
                t * 1e6,
                bytes as f64 / t / 1e9
            );
        }
    }
}

/// Decode's few columns on tensor cores: the DeltaNet q‖k‖v‖z (12,288 × 2048 IQ4_XS, no norm) at 1,
/// 2 and 8 columns as the f32 mat-vec (default shape) and as the cooperative mat-mat with the
/// narrow 128 × 16 tile and the 64 × 64 one, K steps 32 and 64, split over K 1–8 ways (a narrow
/// product gives the GPU few tiles). The cooperative kernel's outputs are the same chain of
/// multiply-adds in any tile or batch, so it could serve every column count of a decode step; the
/// question is whether one column stays near the mat-vec and eight cost about what one does.
fn coop_decode(gpu: &Gpu, rng: &mut Rng) {
    let (rows, k) = if smoke() { (256u32, 512u32) } else { (12288, 2048) };
    let ty = GgmlType::IQ4XS;
    let w = random_matrix(gpu, "coop_decode", ty, u64::from(k), u64::from(rows), rng);
    let x = filled(gpu, "x", 0.5, (8 * k) as usize);
    let y = gpu.buffer_zeroed("y", u64::from(8 * rows) * 4).expect("y");
    let part = gpu
        .buffer_zeroed("partials", 8 * u64::from(8 * rows) * 4)
        .expect("partials");
    let bytes = (w.rows * w.row_bytes) as f64;
    let iters = if smoke() { 1 } else { 20 };
    let kernels = coop_kernels(gpu, &[CoopTile::NARROW_128X16, CoopTile::SQUARE_64]);
    if kernels.is_empty() {
        println!("coop decode: no cooperative matrices on this adapter");
        return;
    }
    for cols in [1u32, 2, 8] {
        hold_clocks(gpu);
        let mv = time_submit(gpu, iters, |rec| {
            let (xc, yc) = (Columns::packed(&x, k), Columns::packed(&y, rows));
            matvec(gpu, rec, &w, xc, yc, cols).expect("matvec")
        });
        println!(
            "coop decode {cols} column(s) ({rows}x{k} {}) mat-vec (default)   {:>8.1} µs  {:>7.1} GB/s",
            ty.name(),
            mv * 1e6,
            bytes / mv / 1e9
        );
        for &kernel in &kernels {
            let mut line = format!("coop decode {cols} column(s) {:<16}", kernel_name(kernel));
            // A tile this adapter cannot build is reported, not fatal to the rest of the bench.
            let mut probe = gpu.recorder();
            let (xc, yc) = (Columns::packed(&x, k), Columns::packed(&y, rows));
            if let Err(e) = matmul_split(gpu, &mut probe, &w, xc, yc, cols, kernel, 1, Some(&part)) {
                println!("{line}  unavailable: {e}");
                continue;
            }
            drop(probe);
            for splits in [1u32, 2, 4, 8] {
                let t = time_submit(gpu, iters, |rec| {
                    let (xc, yc) = (Columns::packed(&x, k), Columns::packed(&y, rows));
                    matmul_split(gpu, rec, &w, xc, yc, cols, kernel, splits, Some(&part)).expect("matmul")
                });
                line += &format!("  split {splits}: {:>7.1} µs", t * 1e6);
            }
            println!("{line}");
        }
    }
}

qk::gpu_params! {
    /// The read-floor probe's immediates (benches/read_floor.wgsl).
    struct ReadFloorParams {
        /// Invocations in the grid: load j of invocation t reads element t + j · threads.
        threads: u32,
        /// The fold is stored only if it equals this (it never does).
        never: u32,
    }
}

const READ_FLOOR: qk::gpu::ShaderFile = qk::gpu::ShaderFile {
    name: "read_floor",
    source: include_str!("read_floor.wgsl"),
    params: &[<ReadFloorParams as qk::gpu::GpuParams>::WGSL],
};

/// The least time a dispatch reading B bytes can take, in a stream of dependent dispatches as the
/// decode step's: plain coalesced loads (every load of an invocation issued before any is used)
/// over 1–48 MiB, per workgroup width × loads per invocation × load width, weights cold (rotating
/// over ≥ 192 MB of copies) and warm; and grids that load nothing, the launch alone. Set against
/// the decode kernels (a 1-column q‖k‖v‖z reads 13.4 MB, the output projection 4.5, a token's
/// gate/up 12.3 and down 6.1), it says how much of a kernel's time is its own work.
fn read_floor(gpu: &Gpu) {
    let small = smoke();
    let iters = if small { 1 } else { 20 };
    let mibs: &[u64] = if small { &[1] } else { &[1, 4, 12, 48] };
    // (workgroup width, loads per invocation, words per load)
    let shapes: &[(u32, u32, u32)] = &[
        (64, 1, 1),
        (64, 4, 1),
        (64, 16, 1),
        (64, 64, 1),
        (256, 4, 1),
        (64, 1, 4),
        (64, 4, 4),
        (64, 16, 4),
        (256, 1, 4),
        (256, 4, 4),
        (256, 16, 4),
        (1024, 4, 4),
    ];
    let out = gpu.buffer_zeroed("read_floor_out", 4096).expect("out");
    let pipe_for = |wg: u32, loads: u32, vec: u32| {
        let defines = [
            ("WG", wg.to_string()),
            ("LOADS", loads.to_string()),
            ("VEC", vec.to_string()),
        ];
        gpu.pipeline(&READ_FLOOR, &defines, &[])
            .expect("read floor pipeline")
    };
    for &mib in mibs {
        let bytes = mib << 20;
        let copies = if small {
            2
        } else {
            (192u64 << 20).div_ceil(bytes).max(2)
        };
        let srcs: Vec<GpuBuffer> = (0..copies)
            .map(|_| gpu.buffer_zeroed("read_floor_src", bytes).expect("src"))
            .collect();
        hold_clocks(gpu);
        let cases: Vec<(u32, u32, u32, bool)> = shapes
            .iter()
            .flat_map(|&(wg, loads, vec)| [(wg, loads, vec, true), (wg, loads, vec, false)])
            .collect();
        let best = best_of_two_passes(gpu, cases.len(), 0.0, 0.1, |i| {
            let (wg, loads, vec, cold) = cases[i];
            let threads = (bytes / 4 / u64::from(loads * vec)) as u32;
            let groups = threads / wg;
            let pipe = pipe_for(wg, loads, vec);
            let p = ReadFloorParams {
                threads,
                never: 0x5eed_f00d,
            };
            let mut at = 0;
            time_submit(gpu, iters, |rec| {
                let src = &srcs[if cold { at % srcs.len() } else { 0 }];
                at += 1;
                rec.dispatch(
                    &pipe,
                    &[src.all(), out.all()],
                    bytemuck::bytes_of(&p),
                    gpu.grid(groups),
                )
                .expect("read floor");
            })
        });
        for (&(wg, loads, vec, cold), t) in cases.iter().zip(best) {
            let groups = bytes / 4 / u64::from(loads * vec * wg);
            println!(
                "read floor {mib:>2} MiB  wg {wg:>4} × {loads:>2} loads of {:>2} B ({groups:>6} workgroups) {:<4} {:>8.1} µs  {:>7.1} GB/s",
                4 * vec,
                if cold { "cold" } else { "warm" },
                t * 1e6,
                bytes as f64 / t / 1e9
            );
        }
    }
    // The launch alone: grids of the decode kernels' sizes that load nothing.
    let empty = pipe_for(64, 0, 1);
    let nothing = gpu.buffer_zeroed("read_floor_nothing", 16).expect("src");
    for groups in [1u32, 132, 1544, 11264] {
        let p = ReadFloorParams {
            threads: groups * 64,
            never: 0x5eed_f00d,
        };
        let t = time_submit(gpu, iters, |rec| {
            rec.dispatch(
                &empty,
                &[nothing.all(), out.all()],
                bytemuck::bytes_of(&p),
                gpu.grid(groups),
            )
            .expect("empty grid")
        });
        println!(
            "read floor: {groups:>6} workgroups of 64 loading nothing {:>8.2} µs",
            t * 1e6
        );
    }
}

/// What a tiny dispatch (one workgroup of the example kernel) costs in a row of them in one submit:
/// each writing the buffers the one before wrote (wgpu puts a barrier between them: a decode step's
/// dependent dispatches), and each writing its own buffers (no barrier), for the floor under every
/// decode kernel. Timed at 20 and at 320 per submit: the difference over the 300 more is the
/// per-dispatch cost without the submit's and the wait's fixed cost (which the 20-row figure shares
/// out over its 20).
fn dispatch_floor(gpu: &Gpu) {
    use qk::gpu::example::{ScaleParams, scale_add};
    let n = 64u32;
    let x = filled(gpu, "x", 1.0, n as usize);
    let outs: Vec<(GpuBuffer, GpuBuffer)> = (0..20)
        .map(|_| {
            (
                gpu.buffer_zeroed("y", u64::from(n) * 4).expect("y"),
                gpu.buffer_zeroed("partial", 4).expect("partial"),
            )
        })
        .collect();
    let params = ScaleParams { n, a: 2.0, b: 1.0 };
    let (short, long) = if smoke() { (2, 4) } else { (20, 320) };
    hold_clocks(gpu);
    let same = |iters| {
        time_submit(gpu, iters, |rec| {
            scale_add(gpu, rec, &x, &outs[0].0, &outs[0].1, params).expect("scale")
        })
    };
    let distinct = |iters| {
        let mut i = 0;
        time_submit(gpu, iters, |rec| {
            let (y, partial) = &outs[i % outs.len()];
            i += 1;
            scale_add(gpu, rec, &x, y, partial, params).expect("scale")
        })
    };
    // Seconds per dispatch of the `long - short` dispatches the longer run adds.
    let slope = |t_short: f64, t_long: f64| {
        (t_long * f64::from(long) - t_short * f64::from(short)) / f64::from(long - short)
    };
    let (same_short, same_long) = (same(short), same(long));
    let (distinct_short, distinct_long) = (distinct(short), distinct(long));
    println!(
        "dispatch floor (one workgroup, {short} in a pass): dependent {:>6.2} µs, independent {:>6.2} µs",
        same_short * 1e6,
        distinct_short * 1e6
    );
    println!(
        "dispatch floor (one workgroup, per added dispatch, {short} → {long} in a pass): dependent {:>6.2} µs, independent {:>6.2} µs",
        slope(same_short, same_long) * 1e6,
        slope(distinct_short, distinct_long) * 1e6
    );
}

/// The host's share of a submit that looks like a decode step: 317 dependent tiny dispatches (each
/// reading the buffer the one before wrote) over pools of 2, 64 and 800 output buffers, so the
/// same GPU work references ~3, ~130 or ~1,600 distinct buffers, as a 48-layer step references its
/// ~800 weight, state and scratch buffers. Median over the rounds of: recording the dispatches,
/// encoding (`finish`), `queue.submit`, and the wait (the GPU's work, then wgpu's bookkeeping of
/// the finished submission). A perf profile of the engine's host-fed step on lavapipe (2026-12-04)
/// had wgpu's per-resource work in the submit (barriers from the device tracker: 53% of it) and
/// in the wait (dropping the finished submission's trackers); this separates that part from the
/// dispatch count.
fn host_step_cost(gpu: &Gpu) {
    use qk::gpu::example::{ScaleParams, scale_add};
    let n = 64u32;
    let dispatches = if smoke() { 32 } else { 317 };
    let rounds = if smoke() { 3 } else { 15 };
    let params = ScaleParams { n, a: 1.0, b: 0.0 };
    for pool in [2usize, 64, 800] {
        let outs: Vec<(GpuBuffer, GpuBuffer)> = (0..pool)
            .map(|_| {
                (
                    filled(gpu, "y", 1.0, n as usize),
                    gpu.buffer_zeroed("partial", 4).expect("partial"),
                )
            })
            .collect();
        let mut times: Vec<[f64; 4]> = Vec::new();
        for round in 0..=rounds {
            let t0 = Instant::now();
            let mut rec = gpu.recorder();
            for i in 0..dispatches {
                let x = &outs[(i + pool - 1) % pool].0;
                let (y, partial) = &outs[i % pool];
                scale_add(gpu, &mut rec, x, y, partial, params).expect("scale");
            }
            let t1 = Instant::now();
            let encoded = rec.finish().expect("encode");
            let t2 = Instant::now();
            let submitted = encoded.submit(gpu);
            let t3 = Instant::now();
            submitted.wait(gpu).expect("wait");
            let t4 = Instant::now();
            if round > 0 {
                let us = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e6;
                times.push([us(t0, t1), us(t1, t2), us(t2, t3), us(t3, t4)]);
            }
        }
        let median = |j: usize| quantile(times.iter().map(|t| t[j]), 1, 2);
        println!(
            "host step ({dispatches} dependent dispatches over {pool} output buffers): record {:>7.1} µs, encode {:>7.1} µs, submit {:>7.1} µs, wait {:>8.1} µs",
            median(0),
            median(1),
            median(2),
            median(3)
        );
    }
    host_step_cost_ranges(gpu, dispatches, rounds);
}

/// [`host_step_cost`]'s 800-buffer case with the inputs, outputs and partial sums as ranges of
/// three buffers (wgpu refuses one buffer bound for reading and writing in a dispatch): as many
/// distinct bind groups, three buffers. What wgpu's submit then
/// costs against the 800 buffers apart is what a weight arena (ranges of a few big buffers) could
/// save the engine's step: its bind groups stay one per dispatch either way.
fn host_step_cost_ranges(gpu: &Gpu, dispatches: usize, rounds: usize) {
    use qk::gpu::example::{SCALE, SCALE_WG, ScaleParams};
    let n = 64u32;
    let pool = 800u64;
    let stride = u64::from(gpu.caps.storage_offset_alignment).max(u64::from(n) * 4);
    let xs = filled(gpu, "xs", 1.0, (pool * stride / 4) as usize);
    let ys = filled(gpu, "ys", 1.0, (pool * stride / 4) as usize);
    let partials = gpu.buffer_zeroed("partials", pool * stride).expect("partials");
    let params = ScaleParams { n, a: 1.0, b: 0.0 };
    let pipe = gpu
        .pipeline(&SCALE, &[("WG", SCALE_WG.to_string())], &[])
        .expect("pipeline");
    let mut times: Vec<[f64; 3]> = Vec::new();
    for round in 0..=rounds {
        let t0 = Instant::now();
        let mut rec = gpu.recorder();
        for i in 0..dispatches as u64 {
            let (at, prev) = ((i % pool) * stride, ((i + pool - 1) % pool) * stride);
            rec.dispatch(
                &pipe,
                &[
                    xs.range(prev, stride),
                    ys.range(at, stride),
                    partials.range(at, stride),
                ],
                bytemuck::bytes_of(&params),
                gpu.grid(n.div_ceil(SCALE_WG)),
            )
            .expect("dispatch");
        }
        let encoded = rec.finish().expect("encode");
        let t1 = Instant::now();
        let submitted = encoded.submit(gpu);
        let t2 = Instant::now();
        submitted.wait(gpu).expect("wait");
        let t3 = Instant::now();
        if round > 0 {
            let us = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e6;
            times.push([us(t0, t1), us(t1, t2), us(t2, t3)]);
        }
    }
    let median = |j: usize| quantile(times.iter().map(|t| t[j]), 1, 2);
    println!(
        "host step ({dispatches} dispatches over {pool} ranges of 3 buffers): record+encode {:>7.1} µs, submit {:>7.1} µs, wait {:>8.1} µs",
        median(0),
        median(1),
        median(2)
    );
}

/// The host's cost of a decode step's inputs (a worker's hidden row, the slot table, the
/// attention rows) written through the queue as separate writes or as one, against none: each
/// write is its own staging buffer in wgpu, made, mapped and later freed, and the submit then
/// carries a command buffer of their copies ahead of the step's own.
fn step_input_writes(gpu: &Gpu) {
    use qk::gpu::example::{ScaleParams, scale_add};
    let n = 2048u32;
    let x = gpu.buffer_zeroed("row_in", u64::from(n) * 4 + 512).expect("x");
    let table = gpu.buffer_zeroed("slot_table", 256).expect("table");
    let rows = gpu.buffer_zeroed("attn_rows", 256).expect("rows");
    let y = gpu.buffer_zeroed("row_out", u64::from(n) * 4).expect("y");
    let partial = gpu.buffer_zeroed("partial", u64::from(n)).expect("partial");
    let row = vec![0.5f32; n as usize + 128];
    let params = ScaleParams { n, a: 2.0, b: 1.0 };
    let rounds = if smoke() { 3 } else { 200 };
    for writes in [0usize, 1, 3] {
        let mut times: [Vec<f64>; 3] = Default::default();
        for _ in 0..rounds {
            let mut rec = gpu.recorder();
            scale_add(gpu, &mut rec, &x, &y, &partial, params).expect("scale");
            let encoded = rec.finish().expect("encode");
            let start = Instant::now();
            match writes {
                0 => {}
                1 => gpu.write(&x, 0, bytemuck::cast_slice(&row)).expect("write"),
                _ => {
                    gpu.write(&x, 0, bytemuck::cast_slice(&row[..n as usize]))
                        .expect("write");
                    gpu.write(&table, 0, bytemuck::cast_slice(&row[..1]))
                        .expect("write");
                    gpu.write(&rows, 0, bytemuck::cast_slice(&row[..2]))
                        .expect("write");
                }
            }
            let written = Instant::now();
            let submitted = encoded.submit(gpu);
            let after_submit = Instant::now();
            submitted.wait(gpu).expect("wait");
            let done = Instant::now();
            for (t, d) in times
                .iter_mut()
                .zip([written - start, after_submit - written, done - after_submit])
            {
                t.push(d.as_secs_f64() * 1e6);
            }
        }
        let median = |v: &Vec<f64>| quantile(v.iter().copied(), 1, 2);
        println!(
            "step inputs as {writes} queue writes: medians write {:>6.1} µs, submit {:>6.1} µs, wait {:>6.1} µs",
            median(&times[0]),
            median(&times[1]),
            median(&times[2]),
        );
    }
}

/// The hand-off cases' one dispatch: a row of `n` f32 in, scaled into a row out, its workgroup
/// partial sums (at least 64 floats each) beside it, and the rounds each case runs (clocks held).
struct HandoffRow {
    n: u32,
    x: GpuBuffer,
    y: GpuBuffer,
    partial: GpuBuffer,
    params: qk::gpu::example::ScaleParams,
    rounds: usize,
}

impl HandoffRow {
    fn new(gpu: &Gpu) -> Self {
        let n = if smoke() { 256u32 } else { 2048 };
        let row = HandoffRow {
            n,
            x: gpu.buffer_zeroed("row_in", u64::from(n) * 4).expect("x"),
            y: gpu.buffer_zeroed("row_out", u64::from(n) * 4).expect("y"),
            partial: gpu.buffer_zeroed("partial", u64::from(n)).expect("partial"),
            params: qk::gpu::example::ScaleParams { n, a: 2.0, b: 1.0 },
            rounds: if smoke() { 3 } else { 200 },
        };
        hold_clocks(gpu);
        row
    }

    /// The dispatch, and with `read` the output row's readback.
    fn record(&self, gpu: &Gpu, rec: &mut Recorder<'_>, read: bool) {
        qk::gpu::example::scale_add(gpu, rec, &self.x, &self.y, &self.partial, self.params).expect("scale");
        if read {
            rec.read(&self.y, 0, u64::from(self.n) * 4).expect("read");
        }
    }
}

/// One hand-off of a split decode step through the host, as a stage pays it per token: a hidden
/// row (n_embd f32) written into a GPU buffer, one tiny dispatch reading it, the row read back and
/// waited for. A 2-stage split on one GPU pays two per token (the head's rows out, the ids back
/// in) on top of the GPU work the unsplit step does: this is their floor, before any socket.
fn handoff_round_trip(gpu: &Gpu) {
    let h = HandoffRow::new(gpu);
    let n = h.n;
    let row = vec![0.5f32; n as usize];
    // Blocking (the driver sleeps until the GPU is done), then spinning on the device's status.
    for (how, spin) in [
        ("blocking", Duration::ZERO),
        ("spinning", Duration::from_millis(50)),
    ] {
        // Per round: whole, then its phases (write + record, encode, submit, wait + map).
        let mut times: [Vec<f64>; 5] = Default::default();
        for _ in 0..h.rounds {
            let start = Instant::now();
            gpu.write(&h.x, 0, bytemuck::cast_slice(&row)).expect("write");
            let mut rec = gpu.recorder();
            h.record(gpu, &mut rec, true);
            let recorded = Instant::now();
            let (out, f) = rec
                .finish()
                .expect("encode")
                .submit(gpu)
                .wait_spinning(gpu, spin)
                .expect("wait");
            std::hint::black_box(out);
            let end = Instant::now();
            for (t, d) in times.iter_mut().zip([
                end - start,
                recorded - start,
                f.encoded - recorded,
                f.submitted - f.encoded,
                f.done - f.submitted,
            ]) {
                t.push(d.as_secs_f64() * 1e6);
            }
        }
        let median = |v: &Vec<f64>| quantile(v.iter().copied(), 1, 2);
        let p90 = quantile(times[0].iter().copied(), 9, 10);
        println!(
            "hand-off round trip {how} (write {n} f32, 1 dispatch, read back, wait): median {:>6.1} µs, \
             p90 {p90:>6.1} µs; medians: write+record {:>5.1}, encode {:>5.1}, submit {:>5.1}, wait+map {:>6.1}",
            median(&times[0]),
            median(&times[1]),
            median(&times[2]),
            median(&times[3]),
            median(&times[4]),
        );
    }
}

/// The hand-off with its commands submitted before its input is due (Vulkan only): the submit waits
/// on a timeline semaphore that the host signals when the input would land (the engine's armed
/// steps, `qk::gpu::armed`), so the GPU starts without a submit in between. Measures the host's
/// signal call and the signal-to-results time (spinning wait, readback mapped) against the plain
/// submit-to-results of the same commands: what a split stage saves per token with its next step
/// queued while the other stage runs.
fn armed_handoff(gpu: &Gpu) {
    let Some(mut armed) = ArmedInputs::new(gpu, 4).expect("armed inputs") else {
        println!("armed hand-off: not a Vulkan device");
        return;
    };
    let h = HandoffRow::new(gpu);
    let spin = Duration::from_millis(50);
    // Per round: plain submit → results, armed signal call, armed signal → results.
    let mut times: [Vec<f64>; 3] = Default::default();
    for round in 0..h.rounds {
        let record = || {
            let mut rec = gpu.recorder();
            h.record(gpu, &mut rec, true);
            rec.finish().expect("encode")
        };
        let plain = record();
        let t0 = Instant::now();
        let (out, _) = plain.submit(gpu).wait_spinning(gpu, spin).expect("wait");
        std::hint::black_box(out);
        let plain_us = t0.elapsed().as_secs_f64() * 1e6;
        let (submitted, value) = armed.submit(gpu, record()).expect("armed submit");
        // The GPU reaches the wait and idles there, as a stage's would while the other stage runs.
        let idle = Instant::now();
        while idle.elapsed() < Duration::from_micros(300) {
            std::hint::spin_loop();
        }
        let t1 = Instant::now();
        // Write-free: the commands take no input, so the signal alone.
        armed.fire(gpu, 0, value, &[]).expect("signal");
        let t2 = Instant::now();
        let (out, _) = submitted.wait_spinning(gpu, spin).expect("armed wait");
        std::hint::black_box(out);
        let t3 = Instant::now();
        if round > 0 {
            let us = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e6;
            times[0].push(plain_us);
            times[1].push(us(t1, t2));
            times[2].push(us(t1, t3));
        }
    }
    let median = |v: &Vec<f64>| quantile(v.iter().copied(), 1, 2);
    let p90 = |v: &Vec<f64>| quantile(v.iter().copied(), 9, 10);
    println!(
        "armed hand-off (write-free, 1 dispatch, read back, spinning): plain submit → results median {:>6.1} µs \
         (p90 {:>6.1}); armed: signal call {:>5.1} µs, signal → results median {:>6.1} µs (p90 {:>6.1})",
        median(&times[0]),
        p90(&times[0]),
        median(&times[1]),
        median(&times[2]),
        p90(&times[2]),
    );
}

/// Where the submit-to-results floor of a hand-off goes: the same spinning wait after a submit of
/// nothing, of one dispatch, and of one dispatch with its 8 KB readback copied out and mapped (what
/// a stage pays), so the driver's share, the GPU's and wgpu's readback path can be told apart.
fn submit_floor(gpu: &Gpu) {
    let h = HandoffRow::new(gpu);
    let spin = Duration::from_millis(50);
    let mut times: [Vec<f64>; 3] = Default::default();
    for round in 0..h.rounds {
        for (case, t) in times.iter_mut().enumerate() {
            let mut rec = gpu.recorder();
            if case > 0 {
                h.record(gpu, &mut rec, case > 1);
            }
            let encoded = rec.finish().expect("encode");
            let start = Instant::now();
            let (out, _) = encoded.submit(gpu).wait_spinning(gpu, spin).expect("wait");
            std::hint::black_box(out);
            if round > 0 {
                t.push(start.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    let median = |v: &Vec<f64>| quantile(v.iter().copied(), 1, 2);
    println!(
        "submit floor (spinning, submit → done, medians): nothing {:>6.1} µs, 1 dispatch {:>6.1} µs, \
         1 dispatch + 8 KB readback mapped {:>6.1} µs",
        median(&times[0]),
        median(&times[1]),
        median(&times[2]),
    );
}

/// The gated DeltaNet decode step (shaders/gdn_step.wgsl) at the Qwen3-Next-80B shape for 1 and 8
/// rows, per spread of the columns ([`GdnStepShape`]: invocations per workgroup, columns per
/// invocation), its states cold as in the engine (each iteration steps other slots of 64, 134 MB
/// of state against the H200's 50 MB L2): µs and GB/s of state read and written.
fn gdn_step_decode(gpu: &Gpu) {
    use qk::ops::gdn_step::{GdnStepArgs, GdnStepParams, GdnStepShape, record_shaped};
    let (nk, nv, dk, dv) = if smoke() {
        (2u32, 4u32, 64u32, 64u32)
    } else {
        (16, 32, 128, 128)
    };
    let (key_dim, vd) = (nk * dk, nv * dv);
    let cd = 2 * key_dim + vd;
    let stride = cd + vd + 2 * nv;
    let rows = 8u32;
    let slots = if smoke() { 16u32 } else { 64 };
    let buf =
        |name: &str, floats: u32, v: f32| gpu.buffer_from_f32(name, &vec![v; floats as usize]).expect(name);
    let proj = buf("proj", rows * stride, 0.01);
    let (ssm_a, dt_bias, norm) = (buf("a", nv, -0.5), buf("dt", nv, 0.1), buf("norm", dv, 1.0));
    let state = buf("state", slots * vd * dk, 0.001);
    let out = buf("out", rows * vd, 0.0);
    let sq = buf("sq", rows * vd, 0.0);
    let slot_table = gpu
        .buffer_from_u32("slots", &(0..slots).collect::<Vec<_>>())
        .expect("slots");
    let args = GdnStepArgs {
        qkv: &proj,
        ba: &proj,
        ssm_a: &ssm_a,
        dt_bias: &dt_bias,
        z: &proj,
        norm: &norm,
        sq: &sq,
        slots: &slot_table,
        state: &state,
        out: &out,
    };
    let iters = if smoke() { 1 } else { 48 };
    let shapes: Vec<GdnStepShape> = [
        (256, 1),
        (64, 1),
        (128, 1),
        (256, 2),
        (128, 2),
        (64, 2),
        (256, 4),
        (128, 4),
        (64, 4),
        (32, 4),
        (64, 8),
    ]
    .map(|(max_wg, columns)| GdnStepShape { max_wg, columns })
    .to_vec();
    for n in [1u32, 8] {
        let p = GdnStepParams {
            rows: n,
            k_heads: nk,
            v_heads: nv,
            dk,
            dv,
            pairing: 0,
            qkv_stride: stride,
            k_offset: key_dim,
            v_offset: 2 * key_dim,
            ba_stride: stride,
            ba_group: nv / nk,
            ba_group_stride: 2 * nv / nk,
            beta_offset: cd + vd,
            alpha_offset: cd + vd + nv / nk,
            z_offset: cd,
            z_stride: stride,
            out_stride: vd,
            state_stride: vd * dk,
            sq_stride: vd,
            eps: 1e-6,
            q_scale: 1.0 / (dk as f32).sqrt(),
            ..Default::default()
        };
        let best = best_of_two_passes(gpu, shapes.len(), 1.0, 0.1, |i| {
            let mut window = 0u32;
            time_submit(gpu, iters, |rec| {
                // The next n slots of the table each iteration (wrapping before its end).
                let p = GdnStepParams {
                    slots_offset: window,
                    ..p
                };
                window = (window + n) % (slots - n + 1);
                record_shaped(gpu, rec, &p, &args, shapes[i]).expect("gdn step");
            })
        });
        for (shape, t) in shapes.iter().zip(best) {
            let bytes = 2.0 * f64::from(n * vd * dk) * 4.0;
            let mark = if *shape == GdnStepShape::for_rows(n) {
                " (default)"
            } else {
                ""
            };
            println!(
                "gdn step decode {n} row(s) ({nv} v-heads, dk {dk}, dv {dv}) workgroup ≤ {:<4} {} column(s) per invocation {:>8.1} µs  {:>7.1} GB/s of state{mark}",
                shape.max_wg,
                shape.columns,
                t * 1e6,
                bytes / t / 1e9
            );
        }
    }
}

/// The MoE of one layer in a decode step at the Qwen3-Next-80B shape (512 routed experts + the shared
/// one stacked as expert 512, 10 + 1 picks, ff 512, n_embd 2048, IQ4_XS) for 1, 2 and 8 tokens: the
/// experts' gate+up per launch shape, and their down projection with the weighted sum either as
/// two dispatches (per-pick down, then the element-wise sum) or as one (`matvec_id_sum`) per shape.
/// GB/s over the weights the picks read (picks × tokens matrices, repeats counted: each is read).
fn moe_decode(gpu: &Gpu, rng: &mut Rng) {
    use qk::ops::elementwise::{self, EwArgs, EwKind, EwParams};
    let (experts, picks, ff, n_embd) = moe_decode_shape();
    let ty = GgmlType::IQ4XS;
    let (gate_up, down) = expert_stacks(gpu, rng, ty, experts, ff, n_embd);
    // Every width × rows × steps per iteration. A row's sum depends on the width alone, so rows and
    // steps may follow the batch size; the width has to suit every batch.
    // (128 invocations for the gate/up, fewer than 4 rows, and 2 steps for the sum were slower
    // everywhere in session 11's sweeps.)
    let mut gate_up_shapes = Vec::new();
    for wg in [32, 64] {
        for rows in [4, 8, 16] {
            for unroll in [1, 2] {
                gate_up_shapes.push(MatvecShape::new(rows, wg, unroll));
            }
        }
    }
    let mut sum_shapes = Vec::new();
    for wg in [64, 128, 256] {
        for rows in [4, 8, 16] {
            sum_shapes.push(MatvecShape::new(rows, wg, 1));
        }
    }
    let iters = if smoke() { 1 } else { 50 };
    let tokens_list: &[u32] = if smoke() { &[1, 8] } else { &[1, 2, 8] };
    for &tokens in tokens_list {
        // The shared expert (the stack's last) is every token's last pick.
        let ids = random_picks(rng, tokens, picks - 1, experts - 1, Some(experts - 1));
        let entries = tokens * picks;
        let idb = gpu.buffer_from_u32("ids", &ids).expect("ids");
        let wb = filled(gpu, "pick_weights", 0.1, entries as usize);
        let x = filled(gpu, "x", 0.5, (tokens * n_embd) as usize);
        let gu = filled(gpu, "gu", 0.5, (entries * 2 * ff) as usize);
        let per_pick = gpu
            .buffer_zeroed("per_pick", u64::from(entries * n_embd) * 4)
            .expect("y");
        let out = gpu
            .buffer_zeroed("out", u64::from(tokens * n_embd) * 4)
            .expect("out");
        let ids_arg = ExpertIds {
            buf: &idb,
            offset: 0,
            n_used: picks,
            n_tokens: tokens,
        };
        // The engine's gate/up routes its tokens itself (matvec.wgsl ROUTE): the router's logits
        // (the routed experts', then the shared expert's gate) in, the picks and weights out.
        let (rlb, rib, rwb) = route_buffers(gpu, rng, 1, tokens, experts, entries);
        let route = MoeRoute {
            logits: &rlb,
            offset: 0,
            stride: experts,
            experts: experts - 1,
            shared: true,
            weights: &rwb,
        };
        let routed_ids = ExpertIds { buf: &rib, ..ids_arg };
        let gu_bytes = f64::from(entries) * (gate_up.rows * gate_up.row_bytes) as f64;
        let down_bytes = f64::from(entries) * (down.rows * down.row_bytes) as f64;
        let report = |name: &str, t: f64, bytes: f64| {
            println!(
                "moe decode {tokens} token(s) × {picks} picks ({}) {name:<28} {:>8.1} µs  {:>7.1} GB/s",
                ty.name(),
                t * 1e6,
                bytes / t / 1e9
            );
        };
        let silu_mul = MatvecInput::SiluMul { up: ff };
        let gate_up_run = |rec: &mut Recorder<'_>, s: Option<MatvecShape>| {
            let y = Columns::packed(&gu, 2 * ff);
            let x = Columns::packed(&x, n_embd);
            let (input, pre) = (MoeInput::PerToken, MatvecInput::Plain);
            matvec_id_with(gpu, rec, &gate_up, x, y, ids_arg, input, pre, s).expect("gate_up");
        };
        // The router kernel (one workgroup per token) writing the picks.
        let route_only = |rec: &mut Recorder<'_>| {
            let rp = qk::ops::router::RouterParams {
                tokens,
                experts: experts - 1,
                k: picks - 1,
                logits_offset: 0,
                logits_token_stride: experts,
            };
            let shared = qk::ops::router::SharedSlot {
                id: experts - 1,
                gate: &rlb,
                gate_offset: experts - 1,
                gate_stride: experts,
            };
            qk::ops::router::record_with(gpu, rec, &rp, &rlb, &rib, &rwb, Some(shared)).expect("router");
        };
        // The other way: the router kernel writes the picks, then the unrouted gate/up reads them:
        // one dispatch more, routing once per token instead of once per workgroup.
        let route_then_gate_up = |rec: &mut Recorder<'_>| {
            route_only(rec);
            let y = Columns::packed(&gu, 2 * ff);
            let x = Columns::packed(&x, n_embd);
            matvec_id(gpu, rec, &gate_up, x, y, routed_ids, MoeInput::PerToken).expect("gate_up");
        };
        let routed_run = |rec: &mut Recorder<'_>| {
            let y = Columns::packed(&gu, 2 * ff);
            let x = Columns::packed(&x, n_embd);
            matvec_id_routed(gpu, rec, &gate_up, x, y, routed_ids, &route, None).expect("routed gate_up");
        };
        let sum_run = |rec: &mut Recorder<'_>, s: Option<MatvecShape>| {
            let gc = Columns::packed(&gu, 2 * ff);
            let y = Columns::packed(&out, n_embd);
            matvec_id_sum(gpu, rec, &down, gc, y, ids_arg, &wb, silu_mul, s).expect("down sum");
        };
        let two_dispatches = |rec: &mut Recorder<'_>| {
            let gc = Columns::packed(&gu, 2 * ff);
            let y = Columns::packed(&per_pick, n_embd);
            matvec_id_with(gpu, rec, &down, gc, y, ids_arg, MoeInput::PerSlot, silu_mul, None).expect("down");
            let p = EwParams {
                rows: tokens,
                n: n_embd,
                a_offset: 0,
                a_stride: picks * n_embd,
                b_offset: 0,
                b_stride: n_embd,
                out_offset: 0,
                out_stride: n_embd,
                weights_offset: 0,
                weights_stride: picks,
                experts: picks,
                accumulate: 1,
                gate_offset: 0,
                gate_stride: 0,
            };
            let args = EwArgs {
                a: &per_pick,
                b: None,
                out: &out,
                weights: Some(&wb),
                gate: None,
            };
            elementwise::record(gpu, rec, EwKind::MoeSum, &p, &args).expect("sum");
        };
        // Each case twice (best_of_two_passes); None: the engine's default shape.
        enum Case {
            GateUp(Option<MatvecShape>),
            GateUpRouted,
            // The router kernel alone: the routing chain's own time (softmax, top-k rounds,
            // renormalised weights), which every layer pays in one form or another.
            RouteOnly,
            RouteThenGateUp,
            DownThenSum,
            DownSum(Option<MatvecShape>),
        }
        let mut cases = vec![Case::GateUp(None)];
        if route_lanes(gpu, experts - 1).is_some() {
            cases.push(Case::GateUpRouted);
            cases.push(Case::RouteOnly);
            cases.push(Case::RouteThenGateUp);
        }
        cases.extend(gate_up_shapes.iter().map(|&s| Case::GateUp(Some(s))));
        cases.extend([Case::DownThenSum, Case::DownSum(None)]);
        cases.extend(sum_shapes.iter().map(|&s| Case::DownSum(Some(s))));
        let label = |s: Option<MatvecShape>, sum: bool| match s {
            Some(s) => shape_name(s),
            None => format!("{} (default)", shape_name(expert_shape(ty, sum))),
        };
        let best = best_of_two_passes(gpu, cases.len(), 1.0, 0.1, |i| match cases[i] {
            Case::GateUp(s) => time_submit(gpu, iters, |rec| gate_up_run(rec, s)),
            Case::GateUpRouted => time_submit(gpu, iters, routed_run),
            Case::RouteOnly => time_submit(gpu, iters, route_only),
            Case::RouteThenGateUp => time_submit(gpu, iters, route_then_gate_up),
            Case::DownThenSum => time_submit(gpu, iters, two_dispatches),
            Case::DownSum(s) => time_submit(gpu, iters, |rec| sum_run(rec, s)),
        });
        for (case, t) in cases.iter().zip(best) {
            match *case {
                Case::GateUp(s) => report(&format!("gate_up {}", label(s, false)), t, gu_bytes),
                Case::GateUpRouted => report("gate_up routing inside (default)", t, gu_bytes),
                Case::RouteOnly => report("router kernel alone", t, 0.0),
                Case::RouteThenGateUp => report("router, then gate_up (2 dispatches)", t, gu_bytes),
                Case::DownThenSum => report("down, then sum (2 dispatches)", t, down_bytes),
                Case::DownSum(s) => report(&format!("down+sum {}", label(s, true)), t, down_bytes),
            }
        }
    }
}

/// A routing-inside gate/up's buffers: random router logits for `sets` sets of `tokens` tokens
/// (the routed experts' and the shared expert's gate, `experts` per token), and the picks and
/// routing weights it writes (`entries` of each).
fn route_buffers(
    gpu: &Gpu,
    rng: &mut Rng,
    sets: u32,
    tokens: u32,
    experts: u32,
    entries: u32,
) -> (GpuBuffer, GpuBuffer, GpuBuffer) {
    let logits = rng.floats((sets * tokens * experts) as usize, 2.0);
    (
        gpu.buffer_from_f32("route_logits", &logits).expect("logits"),
        gpu.buffer_zeroed("route_ids", u64::from(entries) * 4)
            .expect("ids"),
        gpu.buffer_zeroed("route_weights", u64::from(entries) * 4)
            .expect("weights"),
    )
}

/// (experts, picks per token, ff, n_embd) of the decode MoE cases: Qwen3-Next-80B's 512 experts
/// and the shared one stacked as expert 512, 10 + 1 picks (smaller when smoke-testing).
fn moe_decode_shape() -> (u32, u32, u32, u32) {
    if smoke() {
        (17, 5, 256, 256)
    } else {
        (513, 11, 512, 2048)
    }
}

/// The decode MoE layer as the engine meets it: every layer routes to other experts, so its
/// expert weights come from HBM, not from the L2 that the same picks every iteration (moe_decode)
/// keep them in. Iterations rotate over COLD_SETS pick sets (≥ 140 MB of expert rows, the H200's
/// L2 is 50 MB); warm = one set every iteration. The gate/up (picks given, and at one token routing
/// inside) and the down projection with the weighted sum per launch shape, 1 and 8 tokens.
fn moe_decode_cold(gpu: &Gpu, rng: &mut Rng) {
    const COLD_SETS: u32 = 24;
    let (experts, picks, ff, n_embd) = moe_decode_shape();
    let ty = GgmlType::IQ4XS;
    let (gate_up, down) = expert_stacks(gpu, rng, ty, experts, ff, n_embd);
    let iters = if smoke() { 2 } else { 48 };
    let shuffles = Iq4Lookup::Shuffle.effective(gpu, ty, 64) == Iq4Lookup::Shuffle;
    println!(
        "moe decode: +shuffle shapes {}",
        if shuffles {
            "read the IQ4_XS values by subgroup shuffles"
        } else {
            "fall back to the table here"
        }
    );
    let sum_shapes: Vec<Option<MatvecShape>> = std::iter::once(Some(expert_shape(ty, true)))
        .chain(
            [
                (8, 128, 2),
                (16, 128, 1),
                (16, 128, 2),
                (4, 128, 2),
                (8, 256, 1),
                (8, 256, 2),
                (4, 256, 2),
            ]
            .map(|(rows, wg, unroll)| Some(MatvecShape::new(rows, wg, unroll))),
        )
        .collect();
    for tokens in [1u32, 8] {
        let entries = tokens * picks;
        let mut all_ids = Vec::new();
        for _ in 0..COLD_SETS {
            all_ids.extend(random_picks(
                rng,
                tokens,
                picks - 1,
                experts - 1,
                Some(experts - 1),
            ));
        }
        let idb = gpu.buffer_from_u32("ids", &all_ids).expect("ids");
        let wb = filled(gpu, "pick_weights", 0.1, (COLD_SETS * entries) as usize);
        let x = filled(gpu, "x", 0.5, (tokens * n_embd) as usize);
        let gu = filled(gpu, "gu", 0.5, (entries * 2 * ff) as usize);
        let out = gpu
            .buffer_zeroed("out", u64::from(tokens * n_embd) * 4)
            .expect("out");
        let (rlb, rib, rwb) = route_buffers(gpu, rng, COLD_SETS, tokens, experts, entries);
        let ids_of = |set: u32| ExpertIds {
            buf: &idb,
            offset: set * entries,
            n_used: picks,
            n_tokens: tokens,
        };
        let gu_bytes = f64::from(entries) * (gate_up.rows * gate_up.row_bytes) as f64;
        let down_bytes = f64::from(entries) * (down.rows * down.row_bytes) as f64;
        let silu_mul = MatvecInput::SiluMul { up: ff };
        // The set iteration i reads: the same one (warm) or the next of COLD_SETS (cold).
        let set_at = |cold: bool, i: u32| if cold { i % COLD_SETS } else { 0 };
        enum Case {
            GateUp(Option<MatvecShape>),
            GateUpRouted(Option<MatvecShape>),
            DownSum(Option<MatvecShape>),
        }
        // Each default shape also with the IQ4 values from subgroup shuffles.
        // The default shapes with either lookup; at one token, other row counts and unrolls with the
        // shuffles (each keeps its workgroup width, so a row's sum stays the batch's).
        let table = |sum: bool| expert_shape(ty, sum);
        let shuffled = |rows: u32, wg: u32, unroll: u32| {
            Some(MatvecShape::new(rows, wg, unroll).with_lookup(Iq4Lookup::Shuffle))
        };
        let gus = table(false);
        let mut cases = vec![
            Case::GateUp(Some(gus)),
            Case::GateUp(shuffled(gus.rows, gus.wg, 1)),
        ];
        if tokens == 1 && route_lanes(gpu, experts - 1).is_some() {
            cases.push(Case::GateUpRouted(Some(gus)));
            for (rows, unroll) in [(gus.rows, 1), (16, 1), (4, 1), (gus.rows, 2)] {
                cases.push(Case::GateUpRouted(shuffled(rows, gus.wg, unroll)));
            }
        }
        let ds = table(true);
        let sum_rows_unroll: &[(u32, u32)] = if tokens == 1 {
            &[(8, 1), (16, 1), (4, 1), (8, 2)]
        } else {
            &[(8, 1)]
        };
        for &(rows, unroll) in sum_rows_unroll {
            cases.push(Case::DownSum(shuffled(rows, ds.wg, unroll)));
        }
        cases.extend(sum_shapes.iter().map(|&s| Case::DownSum(s)));
        let runs: Vec<(usize, bool)> = (0..cases.len()).flat_map(|c| [(c, false), (c, true)]).collect();
        let best = best_of_two_passes(gpu, runs.len(), 1.0, 0.1, |r| {
            let (c, cold) = runs[r];
            let mut i = 0u32;
            time_submit(gpu, iters, |rec| {
                let set = set_at(cold, i);
                i += 1;
                match cases[c] {
                    Case::GateUp(s) => {
                        let y = Columns::packed(&gu, 2 * ff);
                        let xc = Columns::packed(&x, n_embd);
                        let (ids, plain) = (ids_of(set), MatvecInput::Plain);
                        matvec_id_with(gpu, rec, &gate_up, xc, y, ids, MoeInput::PerToken, plain, s)
                            .expect("gate_up");
                    }
                    Case::GateUpRouted(s) => {
                        let route = MoeRoute {
                            logits: &rlb,
                            offset: set * tokens * experts,
                            stride: experts,
                            experts: experts - 1,
                            shared: true,
                            weights: &rwb,
                        };
                        let routed = ExpertIds {
                            buf: &rib,
                            offset: 0,
                            n_used: picks,
                            n_tokens: tokens,
                        };
                        let y = Columns::packed(&gu, 2 * ff);
                        let xc = Columns::packed(&x, n_embd);
                        matvec_id_routed(gpu, rec, &gate_up, xc, y, routed, &route, s)
                            .expect("routed gate_up");
                    }
                    Case::DownSum(s) => {
                        let gc = Columns::packed(&gu, 2 * ff);
                        let y = Columns::packed(&out, n_embd);
                        let ids = ids_of(set);
                        let weights = &wb;
                        matvec_id_sum(gpu, rec, &down, gc, y, ids, weights, silu_mul, s).expect("down sum");
                    }
                }
            })
        });
        for (&(c, cold), t) in runs.iter().zip(best) {
            let (name, bytes) = match cases[c] {
                Case::GateUp(s) => (
                    format!(
                        "gate_up {}",
                        shape_or_default(s, expert_call_shape(ty, false, false, tokens))
                    ),
                    gu_bytes,
                ),
                Case::GateUpRouted(s) => (
                    format!(
                        "gate_up routing inside {}",
                        shape_or_default(s, expert_call_shape(ty, false, true, tokens))
                    ),
                    gu_bytes,
                ),
                Case::DownSum(s) => (
                    format!(
                        "down+sum {}",
                        shape_or_default(s, expert_call_shape(ty, true, false, tokens))
                    ),
                    down_bytes,
                ),
            };
            println!(
                "moe decode {} {tokens} token(s) × {picks} picks ({}) {name:<34} {:>8.1} µs  {:>7.1} GB/s",
                if cold { "cold" } else { "warm" },
                ty.name(),
                t * 1e6,
                bytes / t / 1e9
            );
        }
    }
}

/// `rows`x`wg`u`unroll`, as the sweeps print a mat-vec launch shape (`+shuffle`: the IQ4 values
/// from subgroup shuffles).
fn shape_name(s: MatvecShape) -> String {
    let lookup = if s.lookup == Iq4Lookup::Shuffle {
        "+shuffle"
    } else {
        ""
    };
    let groups = if s.col_groups > 1 {
        format!("/{}cg", s.col_groups)
    } else {
        String::new()
    };
    format!("{}x{}u{}{lookup}{groups}", s.rows, s.wg, s.unroll)
}

/// A swept shape's name (None: the default), followed by "(default)" where it is the default.
fn shape_or_default(s: Option<MatvecShape>, default: MatvecShape) -> String {
    let s = s.unwrap_or(default);
    let mark = if s == default { " (default)" } else { "" };
    format!("{}{mark}", shape_name(s))
}

/// `time(i)` of every case i < n, the list forward then backward, the faster of each case's two
/// timings. Each pass starts after `pass_hold` seconds of device copies and each case after
/// `case_hold`: the clocks of an idle H200 ramp over the first seconds of a sweep (the first cases
/// looked slow whatever they were), and fall again while a long sweep of short submits runs (in one
/// pass after a single hold every shape from the fifth on read 3-4× slower; 2026-12-02).
fn best_of_two_passes(
    gpu: &Gpu,
    n: usize,
    pass_hold: f64,
    case_hold: f64,
    mut time: impl FnMut(usize) -> f64,
) -> Vec<f64> {
    let mut best = vec![f64::INFINITY; n];
    for pass in 0..2 {
        hold_clocks_for(gpu, pass_hold);
        for j in 0..n {
            let i = if pass == 0 { j } else { n - 1 - j };
            hold_clocks_for(gpu, case_hold);
            best[i] = best[i].min(time(i));
        }
    }
    best
}

/// About a second of device copies, so the clocks have ramped before a sweep is timed.
fn hold_clocks(gpu: &Gpu) {
    hold_clocks_for(gpu, 1.0);
}

thread_local! {
    /// The clock holds' two 64 MB copy buffers, allocated by the first hold and kept (a sweep holds
    /// before every case).
    static CLOCK_BUFFERS: std::cell::OnceCell<(GpuBuffer, GpuBuffer)> = const { std::cell::OnceCell::new() };
}

/// `secs` seconds of device copies.
fn hold_clocks_for(gpu: &Gpu, secs: f64) {
    if smoke() || secs <= 0.0 {
        return;
    }
    let bytes = 64u64 << 20;
    CLOCK_BUFFERS.with(|cell| {
        let (a, b) = cell.get_or_init(|| {
            (
                gpu.buffer_zeroed("clocks_src", bytes).expect("buffer"),
                gpu.buffer_zeroed("clocks_dst", bytes).expect("buffer"),
            )
        });
        let start = Instant::now();
        while start.elapsed().as_secs_f64() < secs {
            let mut rec = gpu.recorder();
            for _ in 0..200 {
                qk::gpu::example::copy_kernel(gpu, &mut rec, a, b, bytes).expect("copy");
            }
            rec.submit().expect("submit");
            gpu.wait().expect("wait");
        }
    });
}

/// The MoE of one layer for a prefill piece at the Qwen3-Next-80B shape (512 experts, 10 used,
/// ff 512, n_embd 2048, IQ4_XS) over 64 tokens (most experts get one or two columns), 512 (about
/// ten each) and 2048 (about forty): the grouping kernel, then gate+up (2·ff rows) and down by the
/// grouped mat-mat per kernel (tiled f32, cooperative 16 and 64 columns wide with K steps 32 and
/// 64), against the per-token mat-vec by ids.
/// TFLOP/s counts the routed products only; GB/s the weights of the experts the piece hits.
fn moe_prefill(gpu: &Gpu, rng: &mut Rng) {
    let pieces: &[u32] = if smoke() { &[40] } else { &[64, 512, 2048] };
    for &tokens in pieces {
        moe_piece(gpu, rng, tokens);
    }
}

fn moe_piece(gpu: &Gpu, rng: &mut Rng, tokens: u32) {
    let (experts, n_used, ff, n_embd) = if smoke() {
        (16u32, 4u32, 256u32, 256u32)
    } else {
        (512, 10, 512, 2048)
    };
    let ty = GgmlType::IQ4XS;
    let (gate_up, down) = expert_stacks(gpu, rng, ty, experts, ff, n_embd);
    let ids = random_picks(rng, tokens, n_used, experts, None);
    let idb = gpu.buffer_from_u32("ids", &ids).expect("ids");
    let entries = tokens * n_used;
    let x = filled(gpu, "x", 0.5, (tokens * n_embd) as usize);
    let act = filled(gpu, "act", 0.5, (entries * ff) as usize);
    let y_gu = gpu
        .buffer_zeroed("y_gu", u64::from(entries * 2 * ff) * 4)
        .expect("y");
    let y_down = gpu
        .buffer_zeroed("y_down", u64::from(entries * n_embd) * 4)
        .expect("y");
    let shape = GroupShape {
        experts,
        n_used,
        n_tokens: tokens,
        tile_cols: qk::ops::matmul::MOE_TILE_COLS,
    };
    let gb = gpu.buffer_zeroed("groups", shape.words() * 4).expect("groups");
    let groups = ExpertGroups { buf: &gb, shape };
    let ids_arg = ExpertIds {
        buf: &idb,
        offset: 0,
        n_used,
        n_tokens: tokens,
    };
    let flops = 2.0 * f64::from(entries) * 3.0 * f64::from(ff) * f64::from(n_embd);
    let mut hit = ids.clone();
    hit.sort_unstable();
    hit.dedup();
    let bytes = (gate_up.rows * gate_up.row_bytes + down.rows * down.row_bytes) * hit.len() as u64;
    let report = |name: &str, t: f64| {
        println!(
            "moe {tokens} tokens × {n_used} of {experts} experts (ff {ff}, n_embd {n_embd}, {}) {name:<12} \
             {:>9.1} µs  {:>7.2} TFLOP/s  {:>7.1} GB/s of the {} experts' weights",
            ty.name(),
            t * 1e6,
            flops / t / 1e12,
            bytes as f64 / t / 1e9,
            hit.len()
        );
    };
    let t = time_submit(gpu, 5, |rec| {
        group_experts(gpu, rec, ids_arg, groups).expect("group")
    });
    println!("moe grouping ({entries} entries): {:>9.1} µs", t * 1e6);
    let mut kernels = vec![MatmulKernel::Tiled];
    kernels.extend(coop_kernels(gpu, &[CoopTile::MOE, CoopTile::MOE_WIDE]));
    let run = |rec: &mut Recorder<'_>, kernel: MatmulKernel| {
        // Each kernel reads groups cut to its own tile width.
        let tile_cols = match kernel {
            MatmulKernel::Coop(t) => t.cols,
            MatmulKernel::Tiled => qk::ops::matmul::MOE_TILE_COLS,
        };
        let groups = ExpertGroups {
            buf: &gb,
            shape: GroupShape { tile_cols, ..shape },
        };
        group_experts(gpu, rec, ids_arg, groups).expect("group");
        let gu_y = Columns::packed(&y_gu, 2 * ff);
        matmul_id(
            gpu,
            rec,
            &gate_up,
            Columns::packed(&x, n_embd),
            gu_y,
            groups,
            MoeInput::PerToken,
            kernel,
        )
        .expect("gate_up");
        let down_y = Columns::packed(&y_down, n_embd);
        matmul_id(
            gpu,
            rec,
            &down,
            Columns::packed(&act, ff),
            down_y,
            groups,
            MoeInput::PerSlot,
            kernel,
        )
        .expect("down");
    };
    for kernel in kernels {
        let t = time_submit(gpu, 5, |rec| run(rec, kernel));
        report(&format!("grouped {}", kernel_name(kernel)), t);
        print_kernel_times(&kernel_times(gpu, |rec| run(rec, kernel)));
    }
    let t = time_submit(gpu, 1, |rec| {
        let gu_y = Columns::packed(&y_gu, 2 * ff);
        matvec_id(
            gpu,
            rec,
            &gate_up,
            Columns::packed(&x, n_embd),
            gu_y,
            ids_arg,
            MoeInput::PerToken,
        )
        .expect("gate_up");
        let down_y = Columns::packed(&y_down, n_embd);
        matvec_id(
            gpu,
            rec,
            &down,
            Columns::packed(&act, ff),
            down_y,
            ids_arg,
            MoeInput::PerSlot,
        )
        .expect("down");
    });
    report("matvec by ids", t);
}

impl Rng {
    /// Uniform in [-scale, scale).
    fn floats(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| ((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale)
            .collect()
    }
}

/// Qwen3-Next-80B attention: 16 q heads over 2 kv heads of dim 256, gated.
const ATTN_HEADS: u32 = 16;
const ATTN_KV_HEADS: u32 = 2;
const ATTN_DIM: u32 = 256;

fn attn_shape(ctx: u32, k_type: KvType, v_type: KvType) -> AttnShape {
    AttnShape {
        heads: ATTN_HEADS,
        kv_heads: ATTN_KV_HEADS,
        head_dim: ATTN_DIM,
        n_rot: 64,
        ctx,
        k_type,
        v_type,
        scale: 1.0 / 16.0,
        eps: 1e-6,
    }
}

/// K and V buffers for `slots` slots (grouped as the engine does), every position filled with
/// random rows in the cache type (a 1024-position pattern uploaded once, then copied on the GPU).
fn filled_cache(
    gpu: &Gpu,
    shape: &AttnShape,
    slots: u32,
    rng: &mut Rng,
) -> Vec<(GpuBuffer, GpuBuffer, u32, u32)> {
    let per_buffer = shape
        .slots_per_buffer(gpu.caps.max_binding_size, gpu.caps.max_buffer_size)
        .expect("one slot fits a binding");
    let pattern_positions = 1024u64.min(u64::from(shape.ctx));
    let pattern = |ty: KvType, rng: &mut Rng| -> GpuBuffer {
        let mut words = Vec::new();
        for _ in 0..pattern_positions * u64::from(shape.kv_heads) {
            words.extend(reference::encode_row(
                ty,
                &rng.floats(shape.head_dim as usize, 2.0),
            ));
        }
        gpu.buffer_from_u32("kv pattern", &words).expect("pattern")
    };
    let (kp, vp) = (pattern(shape.k_type, rng), pattern(shape.v_type, rng));
    let mut groups = Vec::new();
    let mut first = 0;
    while first < slots {
        let n = per_buffer.min(slots - first);
        let cells = u64::from(n) * u64::from(shape.ctx);
        let k = gpu
            .buffer_zeroed("bench k", cells * shape.k_position_bytes())
            .expect("k");
        let v = gpu
            .buffer_zeroed("bench v", cells * shape.v_position_bytes())
            .expect("v");
        for (dst, src) in [(&k, &kp), (&v, &vp)] {
            let mut rec = gpu.recorder();
            let mut at = 0;
            while at < dst.size {
                let len = src.size.min(dst.size - at);
                rec.copy(src, 0, dst, at, len).expect("copy");
                at += len;
            }
            rec.submit().expect("submit");
        }
        groups.push((k, v, first, n));
        first += n;
    }
    gpu.wait().expect("wait");
    groups
}

fn partials(gpu: &Gpu, po: u64, pml: u64) -> (GpuBuffer, GpuBuffer) {
    (
        gpu.buffer_zeroed("part_o", po * 4).expect("part_o"),
        gpu.buffer_zeroed("part_ml", pml * 4).expect("part_ml"),
    )
}

/// Operands with q, the gate logits and the output packed per row (heads × head_dim).
fn packed_args<'a>(
    q: &'a GpuBuffer,
    gate: Option<&'a GpuBuffer>,
    out: &'a GpuBuffer,
    part: &'a (GpuBuffer, GpuBuffer),
) -> CoreArgs<'a> {
    let row_stride = ATTN_HEADS * ATTN_DIM;
    CoreArgs {
        q,
        gate: gate.map(|g| {
            let layout = GateLayout {
                offset: 0,
                row_stride,
                head_stride: ATTN_DIM,
            };
            (g, layout)
        }),
        out,
        out_layout: OutLayout {
            offset: 0,
            row_stride,
        },
        part_o: &part.0,
        part_ml: &part.1,
    }
}

/// Decode attention's operands for up to `rows` rows at the bench's shape: random prepared q and
/// gate logits, the output and the partials.
struct DecodeOperands {
    q: GpuBuffer,
    gate: GpuBuffer,
    out: GpuBuffer,
    part: (GpuBuffer, GpuBuffer),
}

impl DecodeOperands {
    fn random(gpu: &Gpu, rows: u32, rng: &mut Rng) -> Self {
        let qn = (ATTN_HEADS * ATTN_DIM) as usize;
        let (po, pml) = attention::partial_len(rows, 0, ATTN_HEADS, ATTN_DIM);
        DecodeOperands {
            q: gpu
                .buffer_from_f32("q", &rng.floats(rows as usize * qn, 1.0))
                .expect("q"),
            gate: gpu
                .buffer_from_f32("gate", &rng.floats(rows as usize * qn, 2.0))
                .expect("gate"),
            out: gpu
                .buffer_zeroed("out", (rows as usize * qn * 4) as u64)
                .expect("out"),
            part: partials(gpu, po, pml),
        }
    }

    fn args(&self) -> CoreArgs<'_> {
        packed_args(&self.q, Some(&self.gate), &self.out, &self.part)
    }
}

fn kv_views(groups: &[(GpuBuffer, GpuBuffer, u32, u32)]) -> Vec<KvGroup<'_>> {
    groups
        .iter()
        .map(|(k, v, first_slot, slots)| KvGroup {
            k,
            v,
            first_slot: *first_slot,
            slots: *slots,
        })
        .collect()
}

/// Decode attention (split + merge) over depths 512 / 8192 / 65536 / 262144 for 1 and 8 rows (8
/// slots at the same depth; slots that do not fit one binding go to a second buffer pair, one more
/// split dispatch) in each cache type: µs per call, GB/s of K+V read and its share of the copy
/// bandwidth, and for one row at the two shorter depths the NMSE against the f64 reference on the
/// same cache (the H200's 32-lane path is only tested here and by the test binary). Then the
/// prepare op and prefill of 4096 tokens.
fn attention_bench(gpu: &Gpu, copy_gbs: f64, smoke: bool) {
    let depths: &[u32] = if smoke {
        &[64, 512]
    } else {
        &[512, 8192, 65_536, 262_144]
    };
    let max_rows = 8u32;
    let ctx = *depths.last().expect("depths");
    let iters = if smoke { 1 } else { 20 };
    let mut rng = Rng(0xa77e);
    let ops = DecodeOperands::random(gpu, max_rows, &mut rng);
    let rows_buf = gpu.buffer_zeroed("rows", u64::from(max_rows) * 8).expect("rows");
    let args = ops.args();
    println!(
        "attention {ATTN_HEADS} q heads / {ATTN_KV_HEADS} kv heads x {ATTN_DIM}, decode (split + merge, 2 dispatches), \
         {} splits at most:",
        attention::DECODE_MAX_SPLITS
    );
    let mut f16_one_row = Vec::new();
    for (kt, vt) in [
        (KvType::F16, KvType::F16),
        (KvType::Q8_0, KvType::F16),
        (KvType::F32, KvType::F32),
    ] {
        let shape = attn_shape(ctx, kt, vt);
        let groups = filled_cache(gpu, &shape, max_rows, &mut rng);
        let kv = kv_views(&groups);
        println!(
            "  {}/{}: {} buffer pair(s) for {max_rows} slots of {ctx} positions; K+V {:.2} GiB per slot per layer, \
             {:.2} GiB per slot for 12 layers",
            kt.name(),
            vt.name(),
            groups.len(),
            shape.slot_bytes() as f64 / f64::from(1u32 << 30),
            12.0 * shape.slot_bytes() as f64 / f64::from(1u32 << 30)
        );
        for &depth in depths {
            let mut line = format!("  {:>4}/{:<3} depth {depth:>6}:", kt.name(), vt.name());
            for rows in [1u32, max_rows] {
                let pairs: Vec<u32> = (0..rows).flat_map(|r| [r, depth - 1]).collect();
                gpu.write(&rows_buf, 0, bytemuck::cast_slice(&pairs))
                    .expect("rows");
                let t = time_submit(gpu, iters, |rec| {
                    attention::record_decode(
                        gpu,
                        rec,
                        &shape,
                        &rows_buf,
                        rows,
                        &kv,
                        &args,
                        DecodeTuning::DEFAULT,
                    )
                    .expect("decode")
                });
                let bytes = u64::from(rows)
                    * u64::from(depth)
                    * (shape.k_position_bytes() + shape.v_position_bytes());
                let gbs = bytes as f64 / t / 1e9;
                line += &format!(
                    "  {rows} row(s) {:>8.1} µs {gbs:>7.1} GB/s ({:>3.0}% of copy)",
                    t * 1e6,
                    100.0 * gbs / copy_gbs
                );
                if kt == KvType::F16 && rows == 1 {
                    f16_one_row.push((depth, t));
                }
            }
            if depth <= 8192 {
                line += &format!(
                    "  NMSE vs f64 {:.1e}",
                    decode_nmse(gpu, &shape, &groups, &args, depth)
                );
            }
            println!("{line}");
        }
        if kt == KvType::F16 {
            prepare_bench(gpu, &shape, &kv, iters, &mut rng);
        }
    }
    for &(d1, t1) in f16_one_row.iter().skip(1) {
        let (d0, t0) = f16_one_row[0];
        println!(
            "  f16, 1 row: depth {d1} costs {:+.1} µs over depth {d0} per layer ({:+.1} µs per token over 12 layers)",
            (t1 - t0) * 1e6,
            12.0 * (t1 - t0) * 1e6
        );
    }
    prefill_bench(gpu, smoke, iters.min(3), &mut rng);
}

/// NMSE of row 0's output (slot 0 at `depth - 1`, left in `out` by the timed runs) against the f64
/// reference over the cache as stored.
fn decode_nmse(
    gpu: &Gpu,
    shape: &AttnShape,
    groups: &[(GpuBuffer, GpuBuffer, u32, u32)],
    args: &CoreArgs<'_>,
    depth: u32,
) -> f64 {
    let rows = gpu.buffer_from_u32("rows", &[0, depth - 1]).expect("rows");
    let mut rec = gpu.recorder();
    attention::record_decode(
        gpu,
        &mut rec,
        shape,
        &rows,
        1,
        &kv_views(groups),
        args,
        DecodeTuning::DEFAULT,
    )
    .expect("decode");
    rec.submit().expect("submit");
    let qn = (ATTN_HEADS * ATTN_DIM) as usize;
    let got = gpu.read_f32(args.out, 0, qn).expect("out");
    let q = gpu.read_f32(args.q, 0, qn).expect("q");
    let gate = gpu.read_f32(args.gate.expect("gated").0, 0, qn).expect("gate");
    let cells = u64::from(depth) * u64::from(shape.kv_heads);
    let read = |buf: &GpuBuffer, ty: KvType| -> Vec<Vec<f32>> {
        let w = ty.row_words(shape.head_dim) as usize;
        let raw = gpu.read_u32(buf, 0, cells as usize * w).expect("cache");
        raw.chunks(w)
            .map(|r| reference::decode_row(ty, r, shape.head_dim as usize))
            .collect()
    };
    let (k, v) = (read(&groups[0].0, shape.k_type), read(&groups[0].1, shape.v_type));
    let kvh = shape.kv_heads as usize;
    let want = reference::attention_row(
        shape,
        &q,
        Some(&gate),
        depth as usize,
        &|p, g| k[p * kvh + g].clone(),
        &|p, g| v[p * kvh + g].clone(),
    );
    let err: f64 = got.iter().zip(&want).map(|(a, b)| f64::from(a - b).powi(2)).sum();
    err / want.iter().map(|b| f64::from(*b).powi(2)).sum::<f64>()
}

/// The prepare op's inputs for up to `rows` rows: random q ‖ gate ‖ k ‖ v projection rows, unit
/// q/k norm weights and the RoPE frequencies.
struct PrepareInputs {
    layout: ProjLayout,
    proj: GpuBuffer,
    ones: GpuBuffer,
    freqs: GpuBuffer,
}

impl PrepareInputs {
    fn random(gpu: &Gpu, shape: &AttnShape, rows: u32, rng: &mut Rng) -> Self {
        let (h, kvh, hd) = (shape.heads, shape.kv_heads, shape.head_dim);
        let layout = ProjLayout {
            row_stride: 2 * h * hd + 2 * kvh * hd,
            q_offset: 0,
            q_head_stride: 2 * hd,
            k_offset: 2 * h * hd,
            v_offset: 2 * h * hd + kvh * hd,
        };
        let proj = gpu
            .buffer_from_f32("proj", &rng.floats((rows * layout.row_stride) as usize, 2.0))
            .expect("proj");
        let freqs = gpu
            .buffer_from_f32("freqs", &qk::ops::rope::freq_table(shape.n_rot, 1e7))
            .expect("freqs");
        PrepareInputs {
            layout,
            proj,
            ones: filled(gpu, "norm", 1.0, hd as usize),
            freqs,
        }
    }

    /// The op's arguments, prepared q written to `q_out`.
    fn args<'a>(&'a self, q_out: &'a GpuBuffer) -> PrepareArgs<'a> {
        PrepareArgs {
            proj: &self.proj,
            layout: self.layout,
            q_norm: &self.ones,
            k_norm: &self.ones,
            freqs: &self.freqs,
            q_out,
        }
    }
}

/// The prepare op (q/k norms, RoPE, K/V store) for a step of 1 and 8 rows.
fn prepare_bench(gpu: &Gpu, shape: &AttnShape, kv: &[KvGroup<'_>], iters: u32, rng: &mut Rng) {
    let q_out = gpu
        .buffer_zeroed("q_out", u64::from(8 * shape.heads * shape.head_dim) * 4)
        .expect("q_out");
    let inputs = PrepareInputs::random(gpu, shape, 8, rng);
    let args = inputs.args(&q_out);
    let rows_buf = gpu.buffer_zeroed("rows", 64).expect("rows");
    let mut line = format!(
        "  prepare ({} K, {} V):",
        shape.k_type.name(),
        shape.v_type.name()
    );
    for rows in [1u32, 8] {
        let pairs: Vec<u32> = (0..rows).flat_map(|r| [r, 100 + r]).collect();
        gpu.write(&rows_buf, 0, bytemuck::cast_slice(&pairs))
            .expect("rows");
        let t = time_submit(gpu, iters, |rec| {
            let step = AttnRows::Step {
                buf: &rows_buf,
                n: rows,
            };
            attention::record_prepare(gpu, rec, shape, step, kv, &args).expect("prepare")
        });
        line += &format!("  {rows} row(s) {:>6.1} µs", t * 1e6);
    }
    println!("{line}");
}

/// Decode attention as the engine's step runs it (f16 cache of 16,384 positions): each kernel's GPU
/// time (timestamps, one profiled submit of prepare, split and merge) at depths 512 and 8192 for 1
/// and 8 rows, then split + merge per call for every walk of the keys ([`DecodeTuning`]: key
/// columns, keys per column per iteration, shortest split). The cache is cold as in the engine,
/// whose 12 attention layers' caches do not fit the L2: each iteration reads other slots of 64
/// (the first sweep read one row's keys every iteration, warm in L2, and chose a walk that was
/// slower in the engine).
fn attention_decode_sweep(gpu: &Gpu) {
    let smoke = smoke();
    let ctx = if smoke { 1024 } else { 16_384 };
    let max_rows = 8u32;
    let iters = if smoke { 1 } else { 20 };
    let mut rng = Rng(0xa77f);
    let slots = if smoke { 16 } else { 64u32 };
    let shape = attn_shape(ctx, KvType::F16, KvType::F16);
    let groups = filled_cache(gpu, &shape, slots, &mut rng);
    let kv = kv_views(&groups);
    let inputs = PrepareInputs::random(gpu, &shape, max_rows, &mut rng);
    let ops = DecodeOperands::random(gpu, max_rows, &mut rng);
    let args = ops.args();
    let prep = inputs.args(&ops.q);
    let depths: &[u32] = if smoke { &[64, 512] } else { &[512, 8192] };
    let mut tunings = Vec::new();
    for min_split in [16, 32, 64] {
        for cols in [1, 2, 4, 8] {
            for unroll in [1, 2, 4] {
                tunings.push(DecodeTuning {
                    cols,
                    unroll,
                    min_split,
                    ..DecodeTuning::DEFAULT
                });
            }
        }
    }
    println!(
        "attention decode (f16 cache of {ctx} positions, 16 q / 2 kv heads x 256), per kernel and per walk of the keys:"
    );
    for &depth in depths {
        for rows in [1u32, max_rows] {
            // One rows buffer per window of `rows` slots; iteration i reads window i.
            let windows: Vec<GpuBuffer> = (0..slots / rows)
                .map(|w| {
                    let pairs: Vec<u32> = (0..rows).flat_map(|r| [w * rows + r, depth - 1]).collect();
                    gpu.buffer_from_u32("rows", &pairs).expect("rows")
                })
                .collect();
            let rows_buf = &windows[0];
            let step = AttnRows::Step {
                buf: rows_buf,
                n: rows,
            };
            hold_clocks(gpu);
            let times = kernel_times(gpu, |rec| {
                attention::record_prepare(gpu, rec, &shape, step, &kv, &prep).expect("prepare");
                attention::record_decode(
                    gpu,
                    rec,
                    &shape,
                    rows_buf,
                    rows,
                    &kv,
                    &args,
                    DecodeTuning::DEFAULT,
                )
                .expect("decode");
            });
            println!("  depth {depth:>5}, {rows} row(s), one profiled submit (prepare, split, merge):");
            print_kernel_times(&times);
            let mut i = 0;
            let whole = time_submit(gpu, iters, |rec| {
                let buf = &windows[i % windows.len()];
                i += 1;
                let step = AttnRows::Step { buf, n: rows };
                attention::record_prepare(gpu, rec, &shape, step, &kv, &prep).expect("prepare");
                attention::record_decode(gpu, rec, &shape, buf, rows, &kv, &args, DecodeTuning::DEFAULT)
                    .expect("decode");
            });
            println!(
                "    prepare + split + merge per call (default): {:>7.1} µs",
                whole * 1e6
            );
            let best = best_of_two_passes(gpu, tunings.len(), 1.0, 0.05, |t| {
                let mut i = 0;
                time_submit(gpu, iters, |rec| {
                    let buf = &windows[i % windows.len()];
                    i += 1;
                    attention::record_decode(gpu, rec, &shape, buf, rows, &kv, &args, tunings[t])
                        .expect("decode")
                })
            });
            for (t, us) in tunings.iter().zip(best) {
                let mark = if *t == DecodeTuning::DEFAULT {
                    " (default)"
                } else {
                    ""
                };
                println!(
                    "    split + merge cols {:>2} unroll {} min split {:>3}: {:>7.1} µs{mark}",
                    t.cols,
                    t.unroll,
                    t.min_split,
                    us * 1e6
                );
            }
        }
    }
}

/// Prefill attention over an f16 cache with each kernel ([`PrefillKernel`]): 4096 tokens as the
/// engine cuts them (pieces of 512 and of 2048, each attending to everything before it), and the
/// last 2048-row piece of a 32,768-token prompt (its keys 30,720 deep), in ms and TFLOP/s of the
/// causal work (4 · heads · head_dim flops per query-key pair).
fn prefill_bench(gpu: &Gpu, smoke: bool, iters: u32, rng: &mut Rng) {
    let (tokens, deep) = if smoke { (256u32, 512u32) } else { (4096, 32768) };
    let shape = attn_shape(deep, KvType::F16, KvType::F16);
    let groups = filled_cache(gpu, &shape, 1, rng);
    let kv = kv_views(&groups);
    let qn = (ATTN_HEADS * ATTN_DIM) as usize;
    let most = if smoke { 128 } else { 2048u32 };
    let q = gpu
        .buffer_from_f32("q", &rng.floats(most as usize * qn, 1.0))
        .expect("q");
    let out = gpu
        .buffer_zeroed("out", (most as usize * qn * 4) as u64)
        .expect("out");
    let causal = |from: u32, n: u32| {
        let pairs = f64::from(n) * f64::from(from) + f64::from(n) * f64::from(n + 1) / 2.0;
        4.0 * f64::from(ATTN_HEADS * ATTN_DIM) * pairs
    };
    let mut kernels = vec![PrefillKernel::Tiled];
    if attention::coop_prefill_fits(gpu, &shape) {
        kernels.push(PrefillKernel::Coop);
    } else {
        println!("  cooperative prefill attention: not offered here");
    }
    // (label, first position, piece, pieces)
    let whole = format!("{tokens} tokens");
    let last = format!("last piece of {deep}");
    let cases = [
        (whole.as_str(), 0, most / 4, tokens / (most / 4)),
        (whole.as_str(), 0, most, tokens / most),
        (last.as_str(), deep - most, most, 1),
    ];
    for kernel in kernels {
        for (label, first, piece, count) in cases {
            let (po, pml) = attention::partial_len(0, piece, ATTN_HEADS, ATTN_DIM);
            if po * 4 > gpu.caps.max_binding_size {
                println!(
                    "  prefill {label} in pieces of {piece}: partials of {} MiB exceed a binding, skipped",
                    (po * 4) >> 20
                );
                continue;
            }
            let part = partials(gpu, po, pml);
            let args = packed_args(&q, None, &out, &part);
            let t = time_submit(gpu, iters, |rec| {
                for i in 0..count {
                    let pos = first + i * piece;
                    attention::record_prefill(gpu, rec, &shape, 0, pos, piece, &kv, &args, kernel)
                        .expect("prefill");
                }
            });
            let flops: f64 = (0..count).map(|i| causal(first + i * piece, piece)).sum();
            println!(
                "  prefill {label:<18} pieces of {piece:>4} ({kernel:?}, f16 cache): {:>8.2} ms  {:>6.2} TFLOP/s",
                t * 1e3,
                flops / t / 1e12
            );
        }
    }
}
