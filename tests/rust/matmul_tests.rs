//! Matrix kernels vs the CPU reference (`gguf::dequant::dequantize`, then f64 dot products) for
//! every weight type, with subgroups on and off: mat-vec (1..11 columns), tiled mat-mat, MoE
//! mat-vec by ids, the expert grouping and grouped MoE mat-mat, split-K mat-mat, embedding lookup,
//! binding windows (forced small, and one real > 128 MiB); the cooperative-matrix kernels (both K
//! steps) where the adapter has them.
//!
//! Metric: NMSE = Σ(y − ref)² / Σ ref². The GPU dequantises with the same f32 products as the
//! reference and only the summation order and precision differ (f32, K ≤ 4096): relative error per
//! output ≲ 1e-6, so NMSE ≲ 1e-12. The threshold 1e-9 keeps margin for FMA contraction yet a single
//! wrong 32-weight block in a 67-row output already gives NMSE ≳ 1e-5.

use qk::gguf::GgmlType;
use qk::gguf::dequant::dequantize;
use qk::gpu::{Gpu, WeightArena, WeightTensor};
use qk::ops::embed::{Ids, embed};
use qk::ops::matmul::{
    Columns, CoopTile, ExpertGroups, ExpertIds, GroupShape, MAX_SPLITS, MOE_TILE_COLS, MOE_WIDE_TILE_COLS,
    MatmulKernel, MoeInput, Precision, SPLIT_MAX_FLOATS_PER_COL, coop_accumulator, group_experts, k_splits,
    matmul, matmul_id, matmul_split, matmul_with, matvec, matvec_id,
};

use crate::gpu_tests::{checked_test_gpu, same_bits, test_gpu};

const NMSE_MAX: f64 = 1e-9;

/// xorshift64*: deterministic test data without a dependency.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub(crate) fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

fn put_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
}

/// Byte offsets of a block's f16 scale fields (ggml-common.h block structs).
fn f16_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q2K => &[80, 82],
        GgmlType::Q3K => &[108],
        GgmlType::Q6K => &[208],
        GgmlType::IQ1M | GgmlType::MXFP4 => &[],
        _ => &[0],
    }
}

/// Random weights of type `ty`: random bytes for quants with every scale field overwritten by a
/// finite value of a realistic size (IQ1_M's f16 lies in the top nibbles of its scale words,
/// MXFP4's is an E8M0 exponent byte).
pub(crate) fn random_weights(ty: GgmlType, n: usize, rng: &mut Rng) -> Vec<u8> {
    match ty {
        GgmlType::F32 => (0..n).flat_map(|_| rng.f32().to_le_bytes()).collect(),
        GgmlType::F16 => (0..n)
            .flat_map(|_| half::f16::from_f32(rng.f32()).to_le_bytes())
            .collect(),
        GgmlType::BF16 => (0..n)
            .flat_map(|_| half::bf16::from_f32(rng.f32()).to_le_bytes())
            .collect(),
        _ => {
            let bytes = ty.bytes_for(n as u64).expect("whole blocks") as usize;
            let mut b: Vec<u8> = (0..bytes).map(|_| rng.next() as u8).collect();
            let bb = ty.block_bytes();
            for blk in b.chunks_exact_mut(bb) {
                for &at in f16_fields(ty) {
                    put_f16(blk, at, rng.f32() * 0.01);
                }
                match ty {
                    GgmlType::IQ1M => {
                        let d = half::f16::from_f32(rng.f32() * 0.01).to_bits();
                        for k in 0..4 {
                            blk[49 + 2 * k] = (blk[49 + 2 * k] & 0x0f) | (((d >> (4 * k)) as u8 & 15) << 4);
                        }
                    }
                    // 2^(e − 128) between 2^-10 and 2^-4.
                    GgmlType::MXFP4 => blk[0] = 118 + (rng.next() % 7) as u8,
                    _ => {}
                }
            }
            b
        }
    }
}

pub(crate) fn nmse(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let err: f64 = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (f64::from(g) - w).powi(2))
        .sum();
    let norm: f64 = want.iter().map(|w| w * w).sum();
    err / norm.max(f64::MIN_POSITIVE)
}

/// Reference y[c*m + r] = Σ_k w[r*k + k] x[c*k + k] over `cols` columns of x.
fn reference(w: &[f32], x: &[f32], m: usize, k: usize, cols: usize) -> Vec<f64> {
    let mut y = vec![0f64; m * cols];
    for c in 0..cols {
        let xc = &x[c * k..(c + 1) * k];
        for r in 0..m {
            let row = &w[r * k..(r + 1) * k];
            y[c * m + r] = row
                .iter()
                .zip(xc)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum();
        }
    }
    y
}

const TYPES: [GgmlType; 23] = GgmlType::ALL;

struct Case {
    w: WeightTensor,
    dense: Vec<f32>,
}

fn make(gpu: &Gpu, ty: GgmlType, m: usize, k: usize, experts: usize, window: u64, seed: u64) -> Case {
    let mut rng = Rng(seed);
    let bytes = random_weights(ty, m * k * experts, &mut rng);
    let dense = dequantize(ty, &bytes, m * k * experts).expect("reference dequant");
    let w = gpu
        .upload_weight_windowed(
            &format!("w_{ty}"),
            ty,
            k as u64,
            m as u64,
            experts as u64,
            &bytes,
            window,
            None,
        )
        .expect("upload");
    Case { w, dense }
}

/// Mat-vec when `mat_mat` is None, else the given mat-mat kernel (the f32 tests name `Tiled` so
/// the cooperative path, with its own tolerance, never runs under `NMSE_MAX`).
/// The product of `w` with the `cols` columns `x` (matvec, or the mat-mat `kernel`), as the GPU
/// wrote it.
fn product(
    gpu: &Gpu,
    w: &WeightTensor,
    x: &[f32],
    m: usize,
    cols: usize,
    kernel: Option<MatmulKernel>,
) -> Vec<f32> {
    let k = x.len() / cols;
    let xb = gpu.buffer_from_f32("x", x).unwrap();
    let yb = gpu.buffer_zeroed("y", (m * cols * 4) as u64).unwrap();
    let mut rec = gpu.recorder();
    let (xc, yc) = (Columns::packed(&xb, k as u32), Columns::packed(&yb, m as u32));
    if let Some(kernel) = kernel {
        matmul_with(gpu, &mut rec, w, xc, yc, cols as u32, kernel).unwrap();
    } else {
        matvec(gpu, &mut rec, w, xc, yc, cols as u32).unwrap();
    }
    let t = rec.read(&yb, 0, (m * cols * 4) as u64).unwrap();
    bytemuck::pod_collect_to_vec(&rec.finish_and_read().unwrap()[t])
}

fn run_matvec(gpu: &Gpu, case: &Case, m: usize, k: usize, cols: usize, mat_mat: Option<MatmulKernel>) -> f64 {
    let mut rng = Rng(7 + cols as u64);
    let x: Vec<f32> = (0..k * cols).map(|_| rng.f32()).collect();
    let y = product(gpu, &case.w, &x, m, cols, mat_mat);
    nmse(&y, &reference(&case.dense, &x, m, k, cols))
}

#[test]
fn matvec_every_type_subgroups_on_and_off() {
    // 67 rows: not a multiple of the 2 rows per workgroup; K = 512 spans two 256-blocks.
    let (m, k) = (67, 512);
    for off in [false, true] {
        let Some(gpu) = test_gpu(off) else { return };
        for (i, ty) in TYPES.into_iter().enumerate() {
            let case = make(gpu, ty, m, k, 1, u64::MAX, 100 + i as u64);
            for cols in [1, 3, 8, 11] {
                let e = run_matvec(gpu, &case, m, k, cols, None);
                assert!(
                    e < NMSE_MAX,
                    "matvec {ty} cols={cols} subgroups_off={off}: NMSE {e:e}"
                );
            }
        }
    }
}

#[test]
fn matvec_windows_cut_on_rows() {
    let Some(gpu) = test_gpu(false) else { return };
    // Q6_K rows of 210 bytes and Q8_0 rows of 34·8 bytes: windows of ~1 KiB hold a few rows each.
    // IQ2_XS windows hold four rows of 74 bytes and then the grid (2 KiB).
    for ty in [GgmlType::Q6K, GgmlType::Q8_0, GgmlType::F16, GgmlType::IQ2XS] {
        let (m, k) = (37, 256);
        let window = qk::gguf::grids::grid_of(ty).map_or(1000, |g| 4 * 74 + 2 * g.len() as u64 + 3);
        let case = make(gpu, ty, m, k, 1, window, 5);
        assert!(case.w.windows.len() > 3, "{ty}: expected several windows");
        for cols in [1, 2] {
            let e = run_matvec(gpu, &case, m, k, cols, None);
            assert!(e < NMSE_MAX, "windowed matvec {ty}: NMSE {e:e}");
        }
        let e = run_matvec(gpu, &case, m, k, 70, Some(MatmulKernel::Tiled));
        assert!(e < NMSE_MAX, "windowed matmul {ty}: NMSE {e:e}");
    }
}

#[test]
fn weights_in_an_arena_give_the_bytes_of_their_own_buffers() {
    let Some(gpu) = test_gpu(false) else { return };
    let arena = WeightArena::new();
    // Something placed first, so no tensor below starts at byte 0 of the arena's buffer.
    let first = gpu.place(Some(&arena), "first", &[1, 2, 3], &[]).unwrap();
    assert_eq!((first.base, first.size), (0, 4));
    let (m, k) = (37, 512);
    let mut windows = 0;
    for (i, ty) in TYPES.into_iter().enumerate() {
        let mut rng = Rng(300 + i as u64);
        let bytes = random_weights(ty, m * k, &mut rng);
        // Windows of a few rows (an IQ1/IQ2/IQ3 window ends with its grid): several per tensor.
        let row = ty.bytes_for(k as u64).unwrap();
        let window =
            qk::gguf::grids::grid_of(ty).map_or(0, |g| std::mem::size_of_val(g) as u64) + 9 * row + 3;
        let upload = |arena| {
            gpu.upload_weight_windowed("w", ty, k as u64, m as u64, 1, &bytes, window, arena)
                .unwrap()
        };
        let (own, placed) = (upload(None), upload(Some(&arena)));
        assert!(placed.windows.len() > 1, "{ty}: expected several windows");
        assert!(
            placed.windows.iter().all(|w| w.buffer.base > 0),
            "{ty}: not placed"
        );
        windows += placed.windows.len();
        for (cols, kernel) in [(1, None), (8, None), (40, Some(MatmulKernel::Tiled))] {
            let x: Vec<f32> = (0..k * cols).map(|_| rng.f32()).collect();
            let (a, b) = (
                product(gpu, &own, &x, m, cols, kernel),
                product(gpu, &placed, &x, m, cols, kernel),
            );
            assert!(same_bits(&a, &b), "{ty}, {cols} columns: arena bytes differ");
        }
    }
    assert!(
        arena.buffers() * 20 < windows,
        "{windows} windows in {} arena buffers",
        arena.buffers()
    );
    // Too big for an arena: a buffer of its own.
    let big = vec![0u8; qk::gpu::ARENA_MAX_TENSOR as usize + 4];
    assert_eq!(gpu.place(Some(&arena), "big", &big, &[]).unwrap().base, 0);
}

#[test]
fn matmul_every_type() {
    // 67 rows × 70 columns: neither a multiple of the 64×64 tile.
    let (m, k, n) = (67, 512, 70);
    for off in [false, true] {
        let Some(gpu) = test_gpu(off) else { return };
        for (i, ty) in TYPES.into_iter().enumerate() {
            // Mat-mat has no subgroup path; the second device only needs one type.
            if off && i > 0 {
                break;
            }
            let case = make(gpu, ty, m, k, 1, u64::MAX, 200 + i as u64);
            let e = run_matvec(gpu, &case, m, k, n, Some(MatmulKernel::Tiled));
            assert!(e < NMSE_MAX, "matmul {ty}: NMSE {e:e}");
        }
    }
}

#[test]
fn matmul_inner_dim_not_a_tile_multiple() {
    let Some(gpu) = test_gpu(false) else { return };
    // K = 200: a multiple of 8 (the dequant step) but not of the 32-wide K tile.
    for ty in [GgmlType::F16, GgmlType::F32, GgmlType::BF16] {
        let (m, k) = (65, 200);
        let case = make(gpu, ty, m, k, 1, u64::MAX, 9);
        let e = run_matvec(gpu, &case, m, k, 33, Some(MatmulKernel::Tiled));
        assert!(e < NMSE_MAX, "matmul {ty} K=200: NMSE {e:e}");
        let e = run_matvec(gpu, &case, m, k, 3, None);
        assert!(e < NMSE_MAX, "matvec {ty} K=200: NMSE {e:e}");
    }
    // Q8_0 with K = 224 (7 blocks): rows of 238 bytes are not 4-aligned and K is no multiple of
    // the 64-weight block pair, so its mat-vec takes the generic path instead of the word path.
    let case = make(gpu, GgmlType::Q8_0, 45, 224, 1, u64::MAX, 11);
    for cols in [1, 4] {
        let e = run_matvec(gpu, &case, 45, 224, cols, None);
        assert!(e < NMSE_MAX, "matvec Q8_0 K=224 cols={cols}: NMSE {e:e}");
    }
    // Seven 17-byte MXFP4 blocks make 119-byte rows, so every other row starts at an odd byte;
    // Q5_0's 154-byte rows start 2-aligned.
    for ty in [GgmlType::MXFP4, GgmlType::Q5_0] {
        let case = make(gpu, ty, 45, 224, 1, u64::MAX, 12);
        for cols in [1, 40] {
            let kernel = (cols > 8).then_some(MatmulKernel::Tiled);
            let e = run_matvec(gpu, &case, 45, 224, cols, kernel);
            assert!(e < NMSE_MAX, "{ty} K=224 cols={cols}: NMSE {e:e}");
        }
    }
}

/// The cooperative-matrix mat-mat runs with f16 inputs. Each product w·x then carries two f16
/// roundings (relative error uniform within ±2⁻¹¹, variance 2⁻²²/3 each); with independent errors
/// NMSE ≈ 2·2⁻²²/3 ≈ 1.6e-7 for f32 accumulators, so 1e-6 has a 6× margin. With f16 accumulators
/// (only where a device offers no f32 ones) each of the K/16 partial sums is rounded too, adding
/// ≈ (K/16)/2 · 2⁻²²/3 ≈ 1.3e-6 at K = 512: 1e-5 there.
fn coop_nmse_max(acc: &str) -> f64 {
    if acc == "f32" { 1e-6 } else { 1e-5 }
}

/// Fails under QK_REQUIRE_COOP=1 (the H200 run), else says the cooperative path went untested.
pub(crate) fn coop_not_exercised(gpu: &Gpu, what: &str) {
    let why = format!(
        "{what} NOT exercised: {} offers no usable configuration (feature {}, configs {:?}, \
         subgroups {}..{})",
        gpu.adapter.name,
        gpu.caps.cooperative_matrix,
        gpu.caps.cooperative_matrix_configs,
        gpu.caps.subgroup_min_size,
        gpu.caps.subgroup_max_size
    );
    assert!(
        std::env::var("QK_REQUIRE_COOP").as_deref() != Ok("1"),
        "QK_REQUIRE_COOP=1: {why}"
    );
    println!("{why}");
    eprintln!("{why}");
}

#[test]
fn matmul_cooperative_matrix_every_type() {
    // With subgroups off the kernel finds its subgroup from the invocation index (fixed-size
    // subgroups only): a different code path, so both devices run it. Both dense tiles: 64×64 (4
    // subgroups of 32×32), 128×128 (8 of 64×32) and 128×64 (4 of 64×32).
    for off in [false, true] {
        let Some(gpu) = test_gpu(off) else { return };
        for tile in CoopTile::DENSE.into_iter().flat_map(|t| [t, t.with_k_step(64)]) {
            let Some(acc) = coop_accumulator(gpu, tile) else {
                coop_not_exercised(
                    gpu,
                    &format!("cooperative-matrix mat-mat {tile:?} (subgroups_off={off})"),
                );
                continue;
            };
            let kernel = Some(MatmulKernel::Coop(tile));
            let tol = coop_nmse_max(acc);
            // 130 rows × 70 columns: full row tiles plus a partial one, a partial column tile
            // whose last 16-wide matrix is mostly padding. The second device needs fewer types.
            let (m, k, n) = (130, 512, 70);
            for (i, ty) in TYPES.into_iter().enumerate() {
                if off && !matches!(ty, GgmlType::Q8_0 | GgmlType::IQ4XS | GgmlType::F16) {
                    continue;
                }
                let case = make(gpu, ty, m, k, 1, u64::MAX, 500 + i as u64);
                let e = run_matvec(gpu, &case, m, k, n, kernel);
                println!("coop matmul {tile:?} {ty} ({acc} accumulators, subgroups_off={off}): NMSE {e:e}");
                assert!(
                    e < tol,
                    "coop matmul {tile:?} {ty} ({acc} accumulators, subgroups_off={off}): NMSE {e:e} ≥ {tol:e}"
                );
            }
            // K = 200: not a multiple of the 32-wide K tile (zero padding), 33 columns.
            for ty in [GgmlType::F16, GgmlType::F32, GgmlType::BF16] {
                let case = make(gpu, ty, 65, 200, 1, u64::MAX, 9);
                let e = run_matvec(gpu, &case, 65, 200, 33, kernel);
                assert!(e < tol, "coop matmul {tile:?} {ty} K=200: NMSE {e:e}");
            }
            // Windows of a few rows each: every dispatch is an edge tile.
            let case = make(gpu, GgmlType::Q6K, 37, 256, 1, 1000, 5);
            assert!(case.w.windows.len() > 3);
            let e = run_matvec(gpu, &case, 37, 256, 40, kernel);
            assert!(e < tol, "windowed coop matmul {tile:?} Q6_K: NMSE {e:e}");
            println!(
                "cooperative-matrix mat-mat {tile:?} exercised on {} ({acc} accumulators, subgroup {}, \
                 subgroups_off={off})",
                gpu.adapter.name, gpu.caps.subgroup_max_size
            );
        }
    }
}

/// `kernel` over `cols` columns with K cut into `splits` (partials in their own buffer): NMSE
/// against the reference and the output bytes. Output columns have a stride of m + 3 whose extra
/// rows must stay untouched.
fn run_split(
    gpu: &Gpu,
    case: &Case,
    m: usize,
    k: usize,
    cols: usize,
    kernel: MatmulKernel,
    splits: u32,
) -> (f64, Vec<f32>) {
    let mut rng = Rng(31 + cols as u64);
    let x: Vec<f32> = (0..k * cols).map(|_| rng.f32()).collect();
    let xb = gpu.buffer_from_f32("x", &x).unwrap();
    let stride = m + 3;
    let yb = gpu.buffer_from_f32("y", &vec![7.0; stride * cols]).unwrap();
    let part = gpu
        .buffer_zeroed("partials", u64::from(MAX_SPLITS) * (m * cols * 4) as u64)
        .unwrap();
    let mut rec = gpu.recorder();
    let (xc, yc) = (
        Columns::packed(&xb, k as u32),
        Columns::packed(&yb, stride as u32),
    );
    matmul_split(
        gpu,
        &mut rec,
        &case.w,
        xc,
        yc,
        cols as u32,
        kernel,
        splits,
        Some(&part),
    )
    .unwrap();
    let t = rec.read(&yb, 0, (stride * cols * 4) as u64).unwrap();
    let y: Vec<f32> = bytemuck::pod_collect_to_vec(&rec.finish_and_read().unwrap()[t]);
    let mut got = Vec::new();
    for c in 0..cols {
        got.extend_from_slice(&y[c * stride..c * stride + m]);
        assert!(
            y[c * stride + m..(c + 1) * stride].iter().all(|v| *v == 7.0),
            "rows past m written"
        );
    }
    (nmse(&got, &reference(&case.dense, &x, m, k, cols)), got)
}

#[test]
fn matmul_split_k_matches_reference() {
    // Splits of 128-aligned K ranges: K = 512 in 2 and 4, K = 200 in 2 (a ragged last split whose
    // last 32-wide step is zero-padded), a windowed Q6_K tensor (every window writes its rows of
    // the partials); 67 rows × 70 columns are partial tiles both ways.
    let Some(gpu) = test_gpu(false) else { return };
    let mut cases = vec![];
    for (i, ty) in [
        GgmlType::F32,
        GgmlType::Q8_0,
        GgmlType::IQ4XS,
        GgmlType::Q4K,
        GgmlType::F16,
    ]
    .into_iter()
    .enumerate()
    {
        cases.push((ty, 67, 512, u64::MAX, 300 + i as u64));
    }
    cases.push((GgmlType::F16, 65, 200, u64::MAX, 9));
    cases.push((GgmlType::Q6K, 37, 512, 2000, 5));
    let mut kernels = vec![(MatmulKernel::Tiled, NMSE_MAX)];
    for tile in [CoopTile::SQUARE_64, CoopTile::SQUARE_128.with_k_step(64)] {
        match coop_accumulator(gpu, tile) {
            Some(acc) => kernels.push((MatmulKernel::Coop(tile), coop_nmse_max(acc))),
            None => coop_not_exercised(gpu, &format!("split-K cooperative-matrix mat-mat {tile:?}")),
        }
    }
    for (ty, m, k, window, seed) in cases {
        let case = make(gpu, ty, m, k, 1, window, seed);
        if window != u64::MAX {
            assert!(case.w.windows.len() > 3, "{ty}: expected several windows");
        }
        for &(kernel, tol) in &kernels {
            let (_, unsplit) = run_split(gpu, &case, m, k, 70, kernel, 1);
            for splits in [2, 4] {
                let (e, got) = run_split(gpu, &case, m, k, 70, kernel, splits);
                assert!(e < tol, "{kernel:?} {ty} K={k} split {splits}: NMSE {e:e}");
                // A different sum order: close to the unsplit result, and the same bytes every run.
                assert!(got != vec![0.0; got.len()]);
                let (_, again) = run_split(gpu, &case, m, k, 70, kernel, splits);
                assert_eq!(got, again, "{kernel:?} {ty} split {splits}: not deterministic");
                let diff = nmse(&got, &unsplit.iter().map(|&v| f64::from(v)).collect::<Vec<_>>());
                assert!(diff < tol, "{kernel:?} {ty} split {splits} vs unsplit: {diff:e}");
            }
        }
    }
}

#[test]
fn split_count_follows_the_matrix_not_the_columns() {
    // The Qwen3-Next-80B products: few-row matrices split most, wide ones not at all.
    assert_eq!(k_splits(64, 2048), 16, "β/α");
    assert_eq!(k_splits(513, 2048), 16, "router + shared gate");
    assert_eq!(k_splits(1024, 2048), 16, "shared expert gate+up");
    assert_eq!(k_splits(2048, 512), 4, "shared expert down");
    assert_eq!(k_splits(2048, 4096), 8, "out projections");
    assert_eq!(k_splits(4096, 2048), 4, "DeltaNet z");
    assert_eq!(k_splits(8192, 2048), 2, "DeltaNet qkv");
    assert_eq!(k_splits(9216, 2048), 1, "attention q‖k‖v");
    assert_eq!(k_splits(151936, 2048), 1, "LM head");
    // Short K: no split below two 128-long ranges; trailing empty ranges are dropped.
    assert_eq!(k_splits(64, 200), 1);
    assert_eq!(k_splits(64, 256), 2);
    assert_eq!(k_splits(64, 300), 2);
    for rows in [1u64, 63, 64, 65, 700, 5000, 20000] {
        for k in [128u64, 256, 520, 2048, 4096, 16384] {
            let s = u64::from(k_splits(rows, k));
            assert!((1..=u64::from(MAX_SPLITS)).contains(&s));
            assert!(
                s == 1 || s * rows <= SPLIT_MAX_FLOATS_PER_COL,
                "{rows}×{k}: {s} splits"
            );
        }
    }
}

#[test]
fn matmul_splits_as_the_matrix_says() {
    // `matmul` (what the engine calls) splits a 64 × 512 matrix 4 ways: without a partials buffer it
    // refuses, with one it gives the bytes of the explicit 4-way split, for any column count.
    let Some(gpu) = test_gpu(false) else { return };
    let (m, k) = (64, 512);
    assert_eq!(k_splits(m as u64, k as u64), 4);
    let case = make(gpu, GgmlType::Q8_0, m, k, 1, u64::MAX, 17);
    let mut rng = Rng(23);
    let x: Vec<f32> = (0..k * 40).map(|_| rng.f32()).collect();
    let xb = gpu.buffer_from_f32("x", &x).unwrap();
    let yb = gpu.buffer_zeroed("y", (m * 40 * 4) as u64).unwrap();
    let (xc, yc) = (Columns::packed(&xb, k as u32), Columns::packed(&yb, m as u32));
    let mut rec = gpu.recorder();
    let err = matmul(gpu, &mut rec, &case.w, xc, yc, 40, Precision::Precise, None).unwrap_err();
    assert!(err.to_string().contains("partials"), "{err}");
    let small = gpu.buffer_zeroed("small", 4 * (m * 40 * 4) as u64 - 4).unwrap();
    let mut rec = gpu.recorder();
    let err = matmul(
        gpu,
        &mut rec,
        &case.w,
        xc,
        yc,
        40,
        Precision::Precise,
        Some(&small),
    )
    .unwrap_err();
    assert!(err.to_string().contains("partials need"), "{err}");
    let read = |cols: usize, explicit: bool| -> Vec<f32> {
        let part = gpu.buffer_zeroed("partials", 4 * (m * cols * 4) as u64).unwrap();
        let mut rec = gpu.recorder();
        if explicit {
            matmul_split(
                gpu,
                &mut rec,
                &case.w,
                xc,
                yc,
                cols as u32,
                MatmulKernel::Tiled,
                4,
                Some(&part),
            )
        } else {
            matmul(
                gpu,
                &mut rec,
                &case.w,
                xc,
                yc,
                cols as u32,
                Precision::Precise,
                Some(&part),
            )
        }
        .unwrap();
        let t = rec.read(&yb, 0, (m * cols * 4) as u64).unwrap();
        bytemuck::pod_collect_to_vec(&rec.finish_and_read().unwrap()[t])
    };
    let wide = read(40, false);
    assert_eq!(
        wide,
        read(40, true),
        "matmul differs from the explicit 4-way split"
    );
    // The first 9 columns of a 9-column product are the bytes of the 40-column one's.
    assert_eq!(
        read(9, false),
        wide[..m * 9],
        "a row's sums depend on the column count"
    );
}

/// Top-`n_used` distinct experts per token from a fixed stream, skewed so one expert gets many
/// entries (several tiles) and one gets none.
fn routed_ids(experts: usize, n_used: usize, n_tokens: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng(seed);
    let mut ids = Vec::new();
    for _ in 0..n_tokens {
        let mut chosen: Vec<u32> = vec![0];
        while chosen.len() < n_used {
            let e = 1 + (rng.next() % (experts as u64 - 2)) as u32;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        // Slot order is the router's (by weight), not by id.
        chosen.rotate_left((rng.next() % n_used as u64) as usize);
        ids.extend(chosen);
    }
    ids
}

#[test]
fn expert_groups_sort_every_entry_by_expert() {
    let Some(gpu) = test_gpu(false) else { return };
    // Expert 0 in every token (37 or 40 entries: three 16-wide tiles, one 64-wide), the last
    // expert in none: offsets, the tile table and the order must cover every entry once. 300
    // experts spread over more invocations of the scan than one (4 each) and leave most experts
    // empty; 200 tokens give expert 0 more entries than one 64-wide tile.
    for tile_cols in [MOE_TILE_COLS, MOE_WIDE_TILE_COLS] {
        for (experts, n_used, n_tokens) in [(9usize, 3usize, 37usize), (300, 8, 40), (9, 3, 200)] {
            check_expert_groups(gpu, experts, n_used, n_tokens, tile_cols);
        }
    }
}

fn check_expert_groups(gpu: &Gpu, experts: usize, n_used: usize, n_tokens: usize, tile_cols: u32) {
    let ids = routed_ids(experts, n_used, n_tokens, 5);
    let shape = GroupShape {
        experts: experts as u32,
        n_used: n_used as u32,
        n_tokens: n_tokens as u32,
        tile_cols,
    };
    let tile_cols = tile_cols as usize;
    // One id offset of 2 to check it is honoured.
    let mut padded = vec![99u32, 99];
    padded.extend(&ids);
    let idb = gpu.buffer_from_u32("ids", &padded).unwrap();
    let gb = gpu.buffer_zeroed("groups", shape.words() * 4).unwrap();
    let mut rec = gpu.recorder();
    let ids_arg = ExpertIds {
        buf: &idb,
        offset: 2,
        n_used: n_used as u32,
        n_tokens: n_tokens as u32,
    };
    group_experts(gpu, &mut rec, ids_arg, ExpertGroups { buf: &gb, shape }).unwrap();
    let t = rec.read(&gb, 0, shape.words() * 4).unwrap();
    let g: Vec<u32> = bytemuck::pod_collect_to_vec(&rec.finish_and_read().unwrap()[t]);
    let entries = n_used * n_tokens;
    let mut counts = vec![0usize; experts];
    ids.iter().for_each(|&e| counts[e as usize] += 1);
    let offsets = &g[1..experts + 2];
    let mut want_offsets = vec![0u32];
    counts
        .iter()
        .for_each(|c| want_offsets.push(want_offsets.last().unwrap() + *c as u32));
    assert_eq!(offsets, &want_offsets[..]);
    let tiles_at = experts + 2;
    let n_tiles = g[0] as usize;
    let want_tiles: usize = counts.iter().map(|c| c.div_ceil(tile_cols)).sum();
    assert_eq!(n_tiles, want_tiles, "tiles of {tile_cols}");
    let max_tiles = entries.div_ceil(tile_cols) + experts.min(entries);
    let order = &g[tiles_at + 2 * max_tiles..][..entries];
    // Every entry once, each within its expert's range.
    let mut seen = vec![false; entries];
    for e in 0..experts {
        for &entry in &order[offsets[e] as usize..offsets[e + 1] as usize] {
            assert_eq!(
                ids[entry as usize] as usize, e,
                "entry {entry} filed under expert {e}"
            );
            assert!(!seen[entry as usize], "entry {entry} twice");
            seen[entry as usize] = true;
        }
    }
    assert!(seen.iter().all(|s| *s));
    // Tiles: consecutive runs of at most tile_cols inside one expert, covering it.
    let mut covered = 0;
    for i in 0..n_tiles {
        let (e, start) = (g[tiles_at + 2 * i] as usize, g[tiles_at + 2 * i + 1]);
        assert!(start >= offsets[e] && start < offsets[e + 1], "tile {i}");
        covered += (offsets[e + 1] - start).min(tile_cols as u32) as usize;
    }
    assert_eq!(covered, entries);
}

/// Grouped MoE mat-mat by `kernel` against the CPU reference, for both input layouts: NMSE each.
fn run_matmul_id(gpu: &Gpu, ty: GgmlType, window: u64, kernel: MatmulKernel) -> Vec<f64> {
    // 37 tokens: expert 0 takes three 16-wide tiles (one partial 64-wide one).
    matmul_id_outputs(gpu, ty, window, kernel, 37)
        .iter()
        .map(|(got, want)| nmse(got, want))
        .collect()
}

/// Grouped MoE mat-mat by `kernel` over `n_tokens` tokens × 3 of 9 experts (expert 0 in every
/// token, expert 8 in none; 72 rows, a partial row tile, of K = 256): (outputs, CPU reference) for
/// each input layout.
fn matmul_id_outputs(
    gpu: &Gpu,
    ty: GgmlType,
    window: u64,
    kernel: MatmulKernel,
    n_tokens: usize,
) -> Vec<(Vec<f32>, Vec<f64>)> {
    let (m, k, experts, n_used) = (72usize, 256usize, 9usize, 3usize);
    let ids = routed_ids(experts, n_used, n_tokens, 8);
    let case = make(gpu, ty, m, k, experts, window, 41);
    if window != u64::MAX {
        assert!(
            case.w.windows.len() >= 3,
            "expected the expert stack in several windows"
        );
    }
    let idb = gpu.buffer_from_u32("ids", &ids).unwrap();
    let shape = GroupShape {
        experts: experts as u32,
        n_used: n_used as u32,
        n_tokens: n_tokens as u32,
        tile_cols: match kernel {
            MatmulKernel::Tiled => MOE_TILE_COLS,
            MatmulKernel::Coop(t) => t.cols,
        },
    };
    let gb = gpu.buffer_zeroed("groups", shape.words() * 4).unwrap();
    let groups = ExpertGroups { buf: &gb, shape };
    let ids_arg = ExpertIds {
        buf: &idb,
        offset: 0,
        n_used: n_used as u32,
        n_tokens: n_tokens as u32,
    };
    let mut outputs = Vec::new();
    for input in [MoeInput::PerToken, MoeInput::PerSlot] {
        let x_cols = if input == MoeInput::PerToken {
            n_tokens
        } else {
            n_tokens * n_used
        };
        let mut rng = Rng(77);
        let x: Vec<f32> = (0..k * x_cols).map(|_| rng.f32()).collect();
        let xb = gpu.buffer_from_f32("x", &x).unwrap();
        let slots = n_tokens * n_used;
        // Output columns of 80 rows (a stride larger than m): rows past m must stay untouched.
        let yb = gpu.buffer_from_f32("y", &vec![7.0; 80 * slots]).unwrap();
        let mut rec = gpu.recorder();
        let (xc, yc) = (Columns::packed(&xb, k as u32), Columns::packed(&yb, 80));
        group_experts(gpu, &mut rec, ids_arg, groups).unwrap();
        matmul_id(gpu, &mut rec, &case.w, xc, yc, groups, input, kernel).unwrap();
        let t = rec.read(&yb, 0, (80 * slots * 4) as u64).unwrap();
        let y: Vec<f32> = bytemuck::pod_collect_to_vec(&rec.finish_and_read().unwrap()[t]);
        let mut want = Vec::new();
        let mut got = Vec::new();
        for tok in 0..n_tokens {
            for s in 0..n_used {
                let slot = tok * n_used + s;
                let e = ids[slot] as usize;
                let w = &case.dense[e * m * k..(e + 1) * m * k];
                let col = if input == MoeInput::PerToken { tok } else { slot };
                want.extend(reference(w, &x[col * k..(col + 1) * k], m, k, 1));
                got.extend_from_slice(&y[slot * 80..slot * 80 + m]);
                assert!(y[slot * 80 + m..(slot + 1) * 80].iter().all(|v| *v == 7.0));
            }
        }
        outputs.push((got, want));
    }
    outputs
}

#[test]
fn moe_matmul_grouped_by_expert() {
    for off in [false, true] {
        let Some(gpu) = test_gpu(off) else { return };
        for (ty, window) in [
            (GgmlType::IQ4XS, u64::MAX),
            (GgmlType::Q8_0, 3 * 72 * 272),
            (GgmlType::Q4K, u64::MAX),
            (GgmlType::F32, u64::MAX),
        ] {
            if off && ty != GgmlType::Q8_0 {
                continue;
            }
            for e in run_matmul_id(gpu, ty, window, MatmulKernel::Tiled) {
                assert!(e < NMSE_MAX, "grouped {ty} subgroups_off={off}: NMSE {e:e}");
            }
        }
    }
}

#[test]
fn moe_matmul_grouped_cooperative_matrix() {
    for off in [false, true] {
        let Some(gpu) = test_gpu(off) else { return };
        for tile in [
            CoopTile::MOE,
            CoopTile::MOE.with_k_step(64),
            CoopTile::MOE_WIDE,
            CoopTile::MOE_WIDE.with_k_step(64),
        ] {
            let Some(acc) = coop_accumulator(gpu, tile) else {
                coop_not_exercised(
                    gpu,
                    &format!("grouped cooperative-matrix mat-mat {tile:?} (subgroups_off={off})"),
                );
                continue;
            };
            let tol = coop_nmse_max(acc);
            for (ty, window) in [
                (GgmlType::IQ4XS, u64::MAX),
                (GgmlType::Q8_0, 3 * 72 * 272),
                (GgmlType::Q4K, u64::MAX),
            ] {
                for e in run_matmul_id(gpu, ty, window, MatmulKernel::Coop(tile)) {
                    println!(
                        "grouped coop {tile:?} {ty} ({acc} accumulators, subgroups_off={off}): NMSE {e:e}"
                    );
                    assert!(
                        e < tol,
                        "grouped coop {tile:?} {ty} subgroups_off={off}: NMSE {e:e} ≥ {tol:e}"
                    );
                }
            }
        }
    }
}

/// The grouped tile's width is chosen per piece (`moe_tile_cols`), so it must not change a byte:
/// every output column is the same chain of 16-wide multiply-adds in a 16- or a 64-wide tile. 70
/// tokens give expert 0 two 64-wide tiles (one partial) and five 16-wide ones.
#[test]
fn moe_matmul_wide_tile_gives_the_narrow_bytes() {
    for off in [false, true] {
        let Some(gpu) = test_gpu(off) else { return };
        for k_step in [32, 64] {
            let (narrow, wide) = (
                CoopTile::MOE.with_k_step(k_step),
                CoopTile::MOE_WIDE.with_k_step(k_step),
            );
            if coop_accumulator(gpu, narrow).is_none()
                || coop_accumulator(gpu, wide) != coop_accumulator(gpu, narrow)
            {
                coop_not_exercised(
                    gpu,
                    &format!("grouped tiles {narrow:?} and {wide:?} (subgroups_off={off})"),
                );
                continue;
            }
            for ty in [GgmlType::IQ4XS, GgmlType::Q8_0] {
                let want = matmul_id_outputs(gpu, ty, u64::MAX, MatmulKernel::Coop(narrow), 70);
                let got = matmul_id_outputs(gpu, ty, u64::MAX, MatmulKernel::Coop(wide), 70);
                for ((g, _), (w, _)) in got.iter().zip(&want) {
                    assert!(
                        same_bits(g, w),
                        "{ty} K step {k_step} subgroups_off={off}: the 64-wide tile changed the bytes"
                    );
                }
            }
        }
    }
}

#[test]
fn unchecked_shaders_give_the_same_mat_mat_bytes() {
    // The tiled and (where the adapter has them) cooperative mat-mats, dense split over K and
    // grouped by expert, compiled without wgpu's runtime checks: the same bytes.
    let (Some(checked), Some(unchecked)) = (checked_test_gpu(), test_gpu(false)) else {
        return;
    };
    let with_coop = |tile: CoopTile| {
        let mut kernels = vec![MatmulKernel::Tiled];
        kernels.extend(coop_accumulator(checked, tile).map(|_| MatmulKernel::Coop(tile)));
        kernels
    };
    let (m, k) = (130, 768);
    for kernel in with_coop(CoopTile::DENSE[0]) {
        let dense = |g: &Gpu| {
            let case = make(g, GgmlType::IQ4XS, m, k, 1, u64::MAX, 41);
            run_split(g, &case, m, k, 70, kernel, 2).1
        };
        assert!(
            same_bits(&dense(checked), &dense(unchecked)),
            "{kernel:?}: dense bytes changed"
        );
    }
    for kernel in with_coop(CoopTile::MOE) {
        let grouped = |g: &Gpu| matmul_id_outputs(g, GgmlType::IQ4XS, u64::MAX, kernel, 70);
        for ((a, _), (b, _)) in grouped(checked).iter().zip(&grouped(unchecked)) {
            assert!(same_bits(a, b), "{kernel:?}: grouped bytes changed");
        }
    }
}

#[test]
fn moe_matvec_by_ids() {
    let (m, k, experts, n_used, n_tokens) = (40usize, 256usize, 5usize, 3usize, 2usize);
    let ids: Vec<u32> = vec![4, 0, 2, 1, 4, 3];
    for off in [false, true] {
        let Some(gpu) = test_gpu(off) else { return };
        for (ty, window) in [
            (GgmlType::IQ4XS, u64::MAX),
            (GgmlType::Q8_0, 2 * 40 * 272),
            (GgmlType::Q4K, u64::MAX),
            // Two experts of 40 rows of 56 bytes per window, then the 4 KiB IQ1 grid.
            (GgmlType::IQ1M, 2 * 40 * 56 + 4096 + 3),
        ] {
            let case = make(gpu, ty, m, k, experts, window, 31);
            if window != u64::MAX {
                assert!(
                    case.w.windows.len() >= 3,
                    "expected the expert stack in several windows"
                );
            }
            let idb = gpu.buffer_from_u32("ids", &ids).unwrap();
            for input in [MoeInput::PerToken, MoeInput::PerSlot] {
                let x_cols = if input == MoeInput::PerToken {
                    n_tokens
                } else {
                    n_tokens * n_used
                };
                let mut rng = Rng(77);
                let x: Vec<f32> = (0..k * x_cols).map(|_| rng.f32()).collect();
                let xb = gpu.buffer_from_f32("x", &x).unwrap();
                let slots = n_tokens * n_used;
                let yb = gpu.buffer_zeroed("y", (m * slots * 4) as u64).unwrap();
                let mut rec = gpu.recorder();
                let (xc, yc) = (Columns::packed(&xb, k as u32), Columns::packed(&yb, m as u32));
                matvec_id(
                    gpu,
                    &mut rec,
                    &case.w,
                    xc,
                    yc,
                    ExpertIds {
                        buf: &idb,
                        offset: 0,
                        n_used: n_used as u32,
                        n_tokens: n_tokens as u32,
                    },
                    input,
                )
                .unwrap();
                let t = rec.read(&yb, 0, (m * slots * 4) as u64).unwrap();
                let y: Vec<f32> = bytemuck::pod_collect_to_vec(&rec.finish_and_read().unwrap()[t]);
                let mut want = Vec::new();
                for tok in 0..n_tokens {
                    for s in 0..n_used {
                        let e = ids[tok * n_used + s] as usize;
                        let w = &case.dense[e * m * k..(e + 1) * m * k];
                        let col = if input == MoeInput::PerToken {
                            tok
                        } else {
                            tok * n_used + s
                        };
                        want.extend(reference(w, &x[col * k..(col + 1) * k], m, k, 1));
                    }
                }
                let e = nmse(&y, &want);
                assert!(e < NMSE_MAX, "moe {ty} {input:?} subgroups_off={off}: NMSE {e:e}");
            }
        }
    }
}

#[test]
fn embedding_lookup_from_quantised_table() {
    let Some(gpu) = test_gpu(false) else { return };
    let (vocab, dim) = (300usize, 256usize);
    let ids: Vec<u32> = vec![0, 299, 17, 150, 17, 298, 1];
    for (i, ty) in TYPES.into_iter().enumerate() {
        // Windows of ~100 rows so lookups hit several of them.
        let window = 100 * ty.bytes_for(dim as u64).unwrap();
        let case = make(gpu, ty, vocab, dim, 1, window, 300 + i as u64);
        // The ids packed (host-written) and at a stride of 4 words after an offset of 2 (where a
        // chained decode step finds the previous step's top-2 (id, logit) rows).
        let mut strided = vec![u32::MAX; 2 + 4 * ids.len()];
        for (j, &id) in ids.iter().enumerate() {
            strided[2 + 4 * j] = id;
        }
        let packed = gpu.buffer_from_u32("ids", &ids).unwrap();
        let spread = gpu.buffer_from_u32("ids strided", &strided).unwrap();
        let layouts = [
            Ids::packed(&packed),
            Ids {
                buf: &spread,
                offset: 2,
                stride: 4,
            },
        ];
        for source in layouts {
            let out = gpu.buffer_zeroed("emb", (ids.len() * dim * 4) as u64).unwrap();
            let mut rec = gpu.recorder();
            embed(
                gpu,
                &mut rec,
                &case.w,
                source,
                ids.len() as u32,
                Columns::packed(&out, dim as u32),
            )
            .unwrap();
            let t = rec.read(&out, 0, (ids.len() * dim * 4) as u64).unwrap();
            let got: Vec<f32> = bytemuck::pod_collect_to_vec(&rec.finish_and_read().unwrap()[t]);
            for (j, &id) in ids.iter().enumerate() {
                let want = &case.dense[id as usize * dim..(id as usize + 1) * dim];
                // Same f32 products as the reference: the lookup must be exact.
                assert_eq!(
                    &got[j * dim..(j + 1) * dim],
                    want,
                    "embed {ty} token {id} stride {}",
                    source.stride
                );
            }
        }
    }
}

#[test]
fn matvec_tensor_larger_than_128_mib() {
    let Some(gpu) = test_gpu(false) else { return };
    // 32,000 × 4096 Q8_0 = 139,264,000 bytes (132.8 MiB): over lavapipe's 128 MiB binding, so the
    // upload must cut windows and the mat-vec must stitch their outputs.
    let (m, k) = (32_000usize, 4096usize);
    let case = make(gpu, GgmlType::Q8_0, m, k, 1, u64::MAX, 4242);
    if gpu.caps.max_binding_size < case.w.row_bytes * m as u64 {
        assert!(case.w.windows.len() >= 2);
    }
    let e = run_matvec(gpu, &case, m, k, 1, None);
    assert!(e < NMSE_MAX, "large Q8_0 matvec: NMSE {e:e}");
}

#[test]
fn decode_projection_shapes_follow_their_measured_rule() {
    use qk::ops::matmul::{MatvecInput, MatvecShape};
    // The decode step's dense products at the 80B shape (rows × K), the rows per workgroup
    // `MatvecShape::for_matrix` gives each at 1, 2, 4, 5 and 8 columns (its doc has the sweeps).
    let Some(gpu) = test_gpu(false) else { return };
    let buf = gpu.buffer_zeroed("norm", 4 * 4096).unwrap();
    let rms = MatvecInput::Rms {
        weight: &buf,
        eps: 1e-6,
        store: None,
    };
    let head_rms = MatvecInput::HeadRms {
        sums: &buf,
        heads: 32,
        head_dim: 128,
        parts: 16,
        offset: 0,
        stride: 512,
        eps: 1e-6,
    };
    // Past DENSE_GROUP_COLS (4) the columns split into equal groups and the rows follow a group's
    // columns; these are the groups at 1, 2, 4, 5 (which 2 does not divide) and 8 columns.
    let groups = [1, 1, 1, 1, 2];
    let cases = [
        ("q‖k‖v‖z", GgmlType::IQ4XS, 12_288, 2048, rms, [8, 8, 8, 8, 8]),
        (
            "attention q‖k‖v",
            GgmlType::IQ4XS,
            9216,
            2048,
            rms,
            [8, 8, 8, 8, 8],
        ),
        ("router", GgmlType::F32, 513, 2048, rms, [4, 4, 4, 4, 4]),
        (
            "GDN output",
            GgmlType::IQ4XS,
            2048,
            4096,
            head_rms,
            [4, 4, 4, 8, 4],
        ),
        (
            "attention output",
            GgmlType::IQ4XS,
            2048,
            4096,
            MatvecInput::Plain,
            [1, 2, 4, 8, 4],
        ),
    ];
    for (name, ty, rows, k, input, want) in cases {
        for ((ncols, want), groups) in [1, 2, 4, 5, 8].into_iter().zip(want).zip(groups) {
            let shape = MatvecShape::for_matrix(ty, rows, k, ncols, &input);
            assert_eq!(
                (shape.rows, shape.col_groups),
                (want, groups),
                "{name} at {ncols} columns"
            );
            // The width, which fixes how a row's K is split, never follows the columns.
            assert_eq!(
                shape.wg,
                MatvecShape::for_matrix(ty, rows, k, 1, &input).wg,
                "{name}"
            );
        }
    }
    // The big matrices keep the tuned default shapes, ungrouped.
    let lm_head = MatvecShape::for_matrix(GgmlType::IQ4XS, 151_936, 2048, 8, &rms);
    assert_eq!(lm_head.col_groups, 1);
}
