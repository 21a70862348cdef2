//! Kernel tests: CPU references agree with each other where two derivations exist; GPU kernels
//! match their CPU references (shaders_valid.rs validates every shader variant with naga).

use qk::gpu::{Gpu, GpuBuffer};
use qk::ops::{conv, deltanet, elementwise, norm, router, topk};

use crate::gpu_tests::{checked_test_gpu, same_bits, test_gpu};

/// Deterministic pseudo-random numbers in [-1, 1) (xorshift), so failures reproduce.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn uniform(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
}

/// Normalised mean squared error sum((a-b)^2) / sum(b^2) of `got` against `want`.
pub fn nmse(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let err: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - *w as f64).powi(2))
        .sum();
    let norm: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum();
    err / norm.max(f64::MIN_POSITIVE)
}

pub fn max_abs_diff(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .fold(0.0, f32::max)
}

/// A small DeltaNet problem: nk k-heads, nv v-heads, conv output rows [q | k | v] per token and
/// qwen3next-style grouped [b.. a..] logits per k-head.
pub struct DeltaCase {
    pub params: deltanet::DeltaParams,
    pub qkv: Vec<f32>,
    pub ba: Vec<f32>,
    pub ssm_a: Vec<f32>,
    pub dt_bias: Vec<f32>,
    pub state: Vec<f32>,
}

impl DeltaCase {
    pub fn new(
        seed: u64,
        tokens: u32,
        nk: u32,
        nv: u32,
        dk: u32,
        dv: u32,
        pairing: deltanet::HeadPairing,
    ) -> Self {
        let mut rng = Rng::new(seed);
        let stride = 2 * nk * dk + nv * dv;
        let r = nv / nk;
        let grouped = pairing == deltanet::HeadPairing::Grouped;
        let params = deltanet::DeltaParams {
            tokens,
            k_heads: nk,
            v_heads: nv,
            dk,
            dv,
            pairing: pairing as u32,
            qkv_token_stride: stride,
            q_offset: 0,
            k_offset: nk * dk,
            v_offset: 2 * nk * dk,
            ba_token_stride: 2 * nv,
            // qwen3next: per k-group [b (r) | a (r)]; qwen35: [b (nv) | a (nv)].
            ba_group: if grouped { r } else { 1 },
            ba_group_stride: if grouped { 2 * r } else { 1 },
            beta_offset: 0,
            alpha_offset: if grouped { r } else { nv },
            out_token_stride: nv * dv,
            eps: 1e-6,
            q_scale: 1.0 / (dk as f32).sqrt(),
            ..bytemuck::Zeroable::zeroed()
        };
        // Keys of one head share a common direction (as real keys do), so k.k' and hence the
        // intra-chunk matrix A are far from 0 and errors in the triangular solve show.
        let mut qkv = rng.vec((tokens * stride) as usize, 1.0);
        let common = rng.vec((nk * dk) as usize, 1.0);
        for t in 0..tokens as usize {
            for (i, c) in common.iter().enumerate() {
                qkv[t * stride as usize + (nk * dk) as usize + i] += 1.5 * c;
            }
        }
        DeltaCase {
            params,
            qkv,
            ba: rng.vec((tokens * 2 * nv) as usize, 2.0),
            // ssm_a = -exp(A_log) < 0
            ssm_a: rng
                .vec(nv as usize, 1.0)
                .iter()
                .map(|x| -(x * 1.5).exp())
                .collect(),
            dt_bias: rng.vec(nv as usize, 1.0),
            state: rng.vec((nv * dk * dv) as usize, 0.5),
        }
    }

    pub fn out_len(&self) -> usize {
        (self.params.tokens * self.params.v_heads * self.params.dv) as usize
    }
}

#[test]
fn deltanet_reference_chunked_equals_recurrent() {
    // Crosses two chunk boundaries with a partial last chunk; chunk 8 keeps the f64 reference quick
    // while exercising the same algebra as 64.
    for pairing in [deltanet::HeadPairing::Grouped, deltanet::HeadPairing::Tiled] {
        let case = DeltaCase::new(7, 21, 2, 4, 8, 6, pairing);
        let mut s_rec = case.state.clone();
        let mut s_chk = case.state.clone();
        let mut o_rec = vec![0.0; case.out_len()];
        let mut o_chk = vec![0.0; case.out_len()];
        let p = &case.params;
        deltanet::reference::recurrent(
            p,
            &case.qkv,
            &case.ba,
            &case.ssm_a,
            &case.dt_bias,
            &mut s_rec,
            &mut o_rec,
        );
        deltanet::reference::chunked(
            p,
            8,
            &case.qkv,
            &case.ba,
            &case.ssm_a,
            &case.dt_bias,
            &mut s_chk,
            &mut o_chk,
        );
        // Both are f64 inside; only the final f32 rounding differs.
        assert!(
            nmse(&o_chk, &o_rec) < 1e-12,
            "outputs {pairing:?}: {}",
            nmse(&o_chk, &o_rec)
        );
        assert!(
            nmse(&s_chk, &s_rec) < 1e-12,
            "state {pairing:?}: {}",
            nmse(&s_chk, &s_rec)
        );
    }
}

#[test]
fn deltanet_prefill_plan_cuts_at_absolute_chunks() {
    use deltanet::PrefillPlan;
    assert_eq!(
        PrefillPlan::new(0, 200),
        PrefillPlan {
            recurrent_tokens: 0,
            chunked_tokens: 200
        }
    );
    assert_eq!(
        PrefillPlan::new(100, 200),
        PrefillPlan {
            recurrent_tokens: 28,
            chunked_tokens: 172
        }
    );
    assert_eq!(
        PrefillPlan::new(100, 10),
        PrefillPlan {
            recurrent_tokens: 10,
            chunked_tokens: 0
        }
    );
    assert_eq!(PrefillPlan::new(128, 1).chunks(), 1);
}

fn upload(gpu: &Gpu, label: &str, data: &[f32]) -> GpuBuffer {
    gpu.buffer_from_f32(label, data).expect("upload")
}

fn download(gpu: &Gpu, buf: &GpuBuffer, count: usize) -> Vec<f32> {
    gpu.read_f32(buf, 0, count).expect("readback")
}

/// The devices a test runs on: subgroups as offered and forced off (kernels that include
/// common_reduce.wgsl have a subgroup path and a shared-memory path).
fn devices() -> Vec<&'static Gpu> {
    [false, true].into_iter().filter_map(test_gpu).collect()
}

#[test]
fn gpu_norms_match_reference() {
    use norm::{NormArgs, NormKind, NormParams, RowLayout};
    for gpu in devices() {
        let mut rng = Rng::new(11);
        // 3 tokens x 5 heads of n = 40, read from an interleaved layout (as q inside q|gate),
        // written packed; and 4 full rows of n = 200 (more than one pass of the 64 invocations).
        for (tokens, heads, n, src) in [
            (
                3u32,
                5u32,
                40u32,
                RowLayout {
                    offset: 0,
                    token_stride: 5 * 80,
                    head_stride: 80,
                },
            ),
            (4, 1, 200, RowLayout::packed(200, 1)),
        ] {
            let dst = RowLayout::packed(n, heads);
            let src_len = src.extent(tokens, heads, n) as usize;
            let dst_len = dst.extent(tokens, heads, n) as usize;
            let x = rng.vec(src_len, 2.0);
            let other = rng.vec(src_len, 2.0);
            let w = rng.vec(n as usize, 1.5);
            let (xb, ob, wb) = (
                upload(gpu, "x", &x),
                upload(gpu, "other", &other),
                upload(gpu, "w", &w),
            );
            for kind in [
                NormKind::Rms,
                NormKind::RmsResidual,
                NormKind::RmsResidualInPlace,
                NormKind::RmsGated,
                NormKind::L2,
            ] {
                let scale = if kind == NormKind::L2 { 0.25 } else { 1.0 };
                let p = NormParams::new(tokens, heads, n, src, dst, 1e-6, scale);
                let db = gpu.buffer_zeroed("dst", dst_len as u64 * 4).unwrap();
                let sb = gpu.buffer_zeroed("sum", src_len as u64 * 4).unwrap();
                // The in-place form overwrites its source: give it its own copy.
                let in_place = kind == NormKind::RmsResidualInPlace;
                let xb_own = upload(gpu, "x in place", &x);
                let mut rec = gpu.recorder();
                let args = NormArgs {
                    src: if in_place { &xb_own } else { &xb },
                    dst: &db,
                    weight: Some(&wb),
                    other: Some(&ob),
                    sum: Some(&sb),
                };
                norm::record(gpu, &mut rec, kind, &p, &args).unwrap();
                rec.submit().unwrap();
                let mut want = vec![0.0; dst_len];
                let mut want_sum = vec![0.0; src_len];
                norm::reference::norm(kind, &p, &x, &w, &other, &mut want, &mut want_sum);
                let got = download(gpu, &db, dst_len);
                // f32 sums of <= 200 squares against f64: relative error ~1e-7, NMSE ~1e-14.
                let e = nmse(&got, &want);
                assert!(
                    e < 1e-11,
                    "{kind:?} n={n} subgroups={}: nmse {e}",
                    gpu.caps.subgroups
                );
                if matches!(kind, NormKind::RmsResidual | NormKind::RmsResidualInPlace) {
                    // Only the rows' elements are written; x + r is one f32 add on both sides.
                    let got_sum = download(gpu, if in_place { &xb_own } else { &sb }, src_len);
                    for t in 0..tokens as usize {
                        for h in 0..heads as usize {
                            let at = t * src.token_stride as usize + h * src.head_stride as usize;
                            assert_eq!(got_sum[at..at + n as usize], want_sum[at..at + n as usize]);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn gpu_conv_matches_reference_decode_and_prefill() {
    let Some(gpu) = test_gpu(false) else { return };
    let mut rng = Rng::new(3);
    // 70 channels (not a multiple of 64) inside a 90-wide row; K = 4.
    let (channels, taps, stride) = (70u32, 4u32, 90u32);
    let w = rng.vec((channels * taps) as usize, 1.0);
    // The state sits 6 floats into its buffer (another slot's state could come first).
    let state0 = rng.vec((6 + channels * (taps - 1)) as usize, 1.0);
    let x = rng.vec((12 * stride) as usize, 1.0);
    let (wb, xb) = (upload(gpu, "w", &w), upload(gpu, "x", &x));
    let sb = upload(gpu, "state", &state0);
    let yb = gpu.buffer_zeroed("y", (12 * channels * 4) as u64).unwrap();
    let mut want_state = state0.clone();
    let mut want = vec![0.0; (12 * channels) as usize];
    // Decode one token, prefill 8, then 3 more: each call continues from the state.
    let mut start = 0u32;
    for n in [1u32, 8, 3] {
        let p = conv::ConvParams {
            tokens: n,
            channels,
            taps,
            src_offset: start * stride + 5,
            src_token_stride: stride,
            dst_offset: start * channels,
            dst_token_stride: channels,
            state_offset: 6,
        };
        let mut rec = gpu.recorder();
        conv::record(gpu, &mut rec, &p, &xb, &wb, &sb, &yb).unwrap();
        rec.submit().unwrap();
        conv::reference::conv_silu(&p, &x, &w, &mut want_state, &mut want);
        start += n;
    }
    // 4-term f32 dot products against f64.
    let d = max_abs_diff(&download(gpu, &yb, want.len()), &want);
    assert!(d < 1e-5, "outputs: max abs diff {d}");
    assert_eq!(
        download(gpu, &sb, want_state.len()),
        want_state,
        "state = last 3 inputs, copied exactly"
    );
}

#[test]
fn gpu_conv_parallel_pass_equals_token_by_token_walk() {
    let Some(gpu) = test_gpu(false) else { return };
    let mut rng = Rng::new(4);
    // 40 tokens in one call (outputs in parallel, then the state pass) against 40 one-token calls
    // (the serial walk), from the same state: the same sums, so equal bit for bit.
    let (channels, taps, n) = (70u32, 4u32, 40u32);
    assert!(n >= conv::PARALLEL_TOKENS);
    let w = rng.vec((channels * taps) as usize, 1.0);
    let state0 = rng.vec((channels * (taps - 1)) as usize, 1.0);
    let x = rng.vec((n * channels) as usize, 1.0);
    let (wb, xb) = (upload(gpu, "w", &w), upload(gpu, "x", &x));
    let run = |calls: &[(u32, u32)]| {
        let sb = upload(gpu, "state", &state0);
        let yb = gpu.buffer_zeroed("y", u64::from(n * channels) * 4).unwrap();
        for &(start, tokens) in calls {
            let p = conv::ConvParams {
                tokens,
                channels,
                taps,
                src_offset: start * channels,
                src_token_stride: channels,
                dst_offset: start * channels,
                dst_token_stride: channels,
                state_offset: 0,
            };
            let mut rec = gpu.recorder();
            conv::record(gpu, &mut rec, &p, &xb, &wb, &sb, &yb).unwrap();
            rec.submit().unwrap();
        }
        (
            download(gpu, &yb, (n * channels) as usize),
            download(gpu, &sb, state0.len()),
        )
    };
    let one_call = run(&[(0, n)]);
    let walks: Vec<(u32, u32)> = (0..n).map(|t| (t, 1)).collect();
    assert_eq!(one_call, run(&walks));
    // Two parallel calls (the second starts from the first's state) give the same too.
    assert_eq!(one_call, run(&[(0, 17), (17, n - 17)]));
}

struct DeltaGpu {
    qkv: GpuBuffer,
    ba: GpuBuffer,
    ssm_a: GpuBuffer,
    dt_bias: GpuBuffer,
    state: GpuBuffer,
    out: GpuBuffer,
    scratch: GpuBuffer,
}

impl DeltaGpu {
    fn new(gpu: &Gpu, case: &DeltaCase) -> Self {
        let p = &case.params;
        DeltaGpu {
            qkv: upload(gpu, "qkv", &case.qkv),
            ba: upload(gpu, "ba", &case.ba),
            ssm_a: upload(gpu, "ssm_a", &case.ssm_a),
            dt_bias: upload(gpu, "dt_bias", &case.dt_bias),
            state: upload(gpu, "state", &case.state),
            out: gpu.buffer_zeroed("out", case.out_len() as u64 * 4).unwrap(),
            scratch: gpu.buffer_zeroed("scratch", p.scratch_len(p.tokens) * 4).unwrap(),
        }
    }

    fn args(&self) -> deltanet::DeltaArgs<'_> {
        deltanet::DeltaArgs {
            qkv: &self.qkv,
            ba: &self.ba,
            ssm_a: &self.ssm_a,
            dt_bias: &self.dt_bias,
            state: &self.state,
            out: &self.out,
            scratch: Some(&self.scratch),
        }
    }

    /// Runs prefill calls of the given lengths one after another from position 0.
    fn prefill(&self, gpu: &Gpu, case: &DeltaCase, calls: &[u32]) -> (Vec<f32>, Vec<f32>) {
        let mut base = 0;
        for &n in calls {
            let p = deltanet::DeltaParams {
                tokens: n,
                first_token: base,
                ..case.params
            };
            let mut rec = gpu.recorder();
            deltanet::record_prefill(gpu, &mut rec, &p, base, &self.args()).unwrap();
            rec.submit().unwrap();
            base += n;
        }
        (
            download(gpu, &self.out, case.out_len()),
            download(gpu, &self.state, case.state.len()),
        )
    }
}

#[test]
fn deltanet_state_loads_give_the_same_bytes() {
    // The state pass reading W, q, P and k as vec4 sums the same products in the same order: the
    // same outputs and states, at dk 32 and 128 (both multiples of 16), over 150 tokens.
    let Some(gpu) = test_gpu(false) else { return };
    for (nk, nv, dk, dv) in [(2, 4, 32, 24), (1, 2, 128, 128)] {
        let case = DeltaCase::new(21, 150, nk, nv, dk, dv, deltanet::HeadPairing::Grouped);
        let run = |loads| {
            let bufs = DeltaGpu::new(gpu, &case);
            let mut rec = gpu.recorder();
            deltanet::record_chunked_with(gpu, &mut rec, &case.params, &bufs.args(), loads).unwrap();
            rec.submit().unwrap();
            (
                download(gpu, &bufs.out, case.out_len()),
                download(gpu, &bufs.state, case.state.len()),
            )
        };
        let (out, state) = run(deltanet::StateLoads::Scalar);
        let (out4, state4) = run(deltanet::StateLoads::Vec4);
        assert!(same_bits(&out, &out4), "dk {dk}: outputs changed");
        assert!(same_bits(&state, &state4), "dk {dk}: states changed");
    }
}

#[test]
fn unchecked_shaders_give_the_same_bytes() {
    // Without wgpu's index clamps, loop counters and division guards the kernels must compute the
    // same bytes: the chunked DeltaNet (workgroup arrays, data-dependent loops, divisions by
    // parameters) over 150 tokens at the real head size, and the recurrent form after it.
    let (Some(checked), Some(unchecked)) = (checked_test_gpu(), test_gpu(false)) else {
        return;
    };
    assert!(unchecked.unchecked_shaders && !checked.unchecked_shaders);
    let case = DeltaCase::new(21, 150, 1, 2, 128, 128, deltanet::HeadPairing::Grouped);
    let run = |g: &Gpu| {
        let bufs = DeltaGpu::new(g, &case);
        let chunked = bufs.prefill(g, &case, &[64, 86]);
        let mut rec = g.recorder();
        deltanet::record_recurrent(g, &mut rec, &case.params, &bufs.args()).unwrap();
        rec.submit().unwrap();
        let recurrent = download(g, &bufs.out, case.out_len());
        (chunked, recurrent)
    };
    let ((out, state), rec) = run(checked);
    let ((out_u, state_u), rec_u) = run(unchecked);
    assert!(
        same_bits(&out, &out_u) && same_bits(&state, &state_u),
        "chunked bytes changed"
    );
    assert!(same_bits(&rec, &rec_u), "recurrent bytes changed");
}

#[test]
fn gpu_deltanet_recurrent_and_chunked_match_reference() {
    let Some(gpu) = test_gpu(false) else { return };
    // 150 tokens cross the chunk boundaries 64 and 128 and end in a partial chunk; dv = 24 leaves
    // a partial column block; 2 k-heads over 4 v-heads for both pairings. The last case has the
    // real head size dk = dv = 128 (the largest the kernels hold: every staged slice full).
    use deltanet::HeadPairing::{Grouped, Tiled};
    for (pairing, tokens, nk, nv, dk, dv) in [
        (Grouped, 150, 2, 4, 32, 24),
        (Tiled, 150, 2, 4, 32, 24),
        (Grouped, 150, 1, 2, 128, 128),
    ] {
        let case = DeltaCase::new(21, tokens, nk, nv, dk, dv, pairing);
        let p = &case.params;
        let mut want_state = case.state.clone();
        let mut want = vec![0.0; case.out_len()];
        deltanet::reference::recurrent(
            p,
            &case.qkv,
            &case.ba,
            &case.ssm_a,
            &case.dt_bias,
            &mut want_state,
            &mut want,
        );

        let rec_bufs = DeltaGpu::new(gpu, &case);
        let mut rec = gpu.recorder();
        deltanet::record_recurrent(gpu, &mut rec, p, &rec_bufs.args()).unwrap();
        rec.submit().unwrap();
        let got = download(gpu, &rec_bufs.out, case.out_len());
        let got_state = download(gpu, &rec_bufs.state, case.state.len());
        // f32 against f64 over 150 steps: measured NMSE ~5e-14 on lavapipe; 1e-11 leaves margin for
        // other devices' exp/FMA while still catching a 1e-4 relative error anywhere in the math.
        assert!(
            nmse(&got, &want) < 1e-11,
            "recurrent {pairing:?} out: {}",
            nmse(&got, &want)
        );
        assert!(
            nmse(&got_state, &want_state) < 1e-11,
            "recurrent {pairing:?} state"
        );

        let one = DeltaGpu::new(gpu, &case);
        let (out_one, state_one) = one.prefill(gpu, &case, &[150]);
        // Chunked f32 (64-row triangular solve, dk-term dots) against the f64 recurrence: ~8e-14.
        println!(
            "chunked {pairing:?} dk {dk} dv {dv}: NMSE out {:.2e} state {:.2e}",
            nmse(&out_one, &want),
            nmse(&state_one, &want_state)
        );
        assert!(
            nmse(&out_one, &want) < 1e-11,
            "chunked {pairing:?} out: {}",
            nmse(&out_one, &want)
        );
        assert!(nmse(&state_one, &want_state) < 1e-11, "chunked {pairing:?} state");

        // Cut at a multiple of 64: the same chunks are computed, so the result is bit-identical.
        let aligned = DeltaGpu::new(gpu, &case);
        let (out_aligned, state_aligned) = aligned.prefill(gpu, &case, &[128, 22]);
        assert_eq!(
            out_aligned, out_one,
            "{pairing:?}: a 64-aligned cut changed the outputs"
        );
        assert_eq!(
            state_aligned, state_one,
            "{pairing:?}: a 64-aligned cut changed the state"
        );

        // Cut mid-chunk (and a decode-like single token): recurrent up to the boundary, so the
        // result agrees with one call to rounding.
        let cut = DeltaGpu::new(gpu, &case);
        let (out_cut, state_cut) = cut.prefill(gpu, &case, &[100, 1, 49]);
        assert!(
            nmse(&out_cut, &out_one) < 1e-11,
            "mid-chunk cut {pairing:?}: {}",
            nmse(&out_cut, &out_one)
        );
        assert!(
            nmse(&state_cut, &state_one) < 1e-11,
            "mid-chunk cut {pairing:?} state"
        );
    }
}

#[test]
fn gpu_router_matches_reference() {
    for gpu in devices() {
        let mut rng = Rng::new(9);
        // 3 tokens, 70 experts (not a multiple of 64) in rows of 72, top-6.
        let p = router::RouterParams {
            tokens: 3,
            experts: 70,
            k: 6,
            logits_offset: 2,
            logits_token_stride: 72,
        };
        let mut logits = rng.vec(2 + 3 * 72, 4.0);
        // A tie inside the top-k of token 1: equal logits must come back lowest id first.
        let best = (0..70)
            .max_by(|a, b| logits[74 + a].total_cmp(&logits[74 + b]))
            .unwrap();
        logits[74 + 69] = logits[74 + best];
        let lb = upload(gpu, "logits", &logits);
        let ib = gpu.buffer_zeroed("ids", 18 * 4).unwrap();
        let wb = gpu.buffer_zeroed("weights", 18 * 4).unwrap();
        let mut rec = gpu.recorder();
        router::record(gpu, &mut rec, &p, &lb, &ib, &wb).unwrap();
        rec.submit().unwrap();
        let (want_ids, want_w) = router::reference::route(&p, &logits);
        assert_eq!(
            gpu.read_u32(&ib, 0, 18).unwrap(),
            want_ids,
            "subgroups={}",
            gpu.caps.subgroups
        );
        assert_eq!(want_ids[6..8], [best as u32, 69]);
        // f32 softmax against f64: relative ~1e-7 on weights <= 1.
        let d = max_abs_diff(&download(gpu, &wb, 18), &want_w);
        assert!(d < 1e-6, "weights: max abs diff {d}");
    }
}

#[test]
fn gpu_topk_full_vocabulary_matches_reference() {
    let Some(gpu) = test_gpu(false) else { return };
    let mut rng = Rng::new(1);
    let vocab = 248_320u32;
    let mut logits = rng.vec(vocab as usize + 8, 10.0);
    // Ties at the top and across first-pass blocks: the lower id must win.
    logits[8 + 200_000] = 50.0;
    logits[8 + 17] = 50.0;
    logits[8 + 4096 * 3 + 1] = 40.0;
    logits[8 + 4096 * 3] = 40.0;
    let lb = upload(gpu, "logits", &logits);
    for k in [1u32, 256] {
        let p = topk::TopkParams::new(vocab, k, 8).unwrap();
        let cb = gpu
            .buffer_zeroed("candidates", p.candidates() as u64 * 8)
            .unwrap();
        let rb = gpu.buffer_zeroed("result", k as u64 * 8).unwrap();
        let mut rec = gpu.recorder();
        topk::record(gpu, &mut rec, &p, &lb, &cb, &rb).unwrap();
        rec.submit().unwrap();
        let got: Vec<topk::IdLogit> =
            bytemuck::pod_collect_to_vec(&gpu.read_bytes(&rb, 0, k as u64 * 8).unwrap());
        let want = topk::reference::top_k(&logits[8..], k as usize);
        assert_eq!(got, want, "k = {k}");
        assert_eq!(got[0].id, 17);
    }
}

/// Several rows in the same two dispatches give each row's own top-k (rows strided apart, ties
/// and a shared maximum across rows included).
#[test]
fn gpu_topk_rows_match_reference_per_row() {
    let Some(gpu) = test_gpu(false) else { return };
    let mut rng = Rng::new(2);
    let (vocab, stride, rows) = (9_000u32, 9_004u32, 3u32);
    let mut logits = rng.vec((4 + rows * stride) as usize, 10.0);
    logits[4 + 5] = 60.0;
    logits[4 + stride as usize + 8_999] = 60.0;
    logits[4 + 2 * stride as usize + 4_096] = 30.0;
    logits[4 + 2 * stride as usize + 4_095] = 30.0;
    let lb = upload(gpu, "logits", &logits);
    for k in [1u32, 7] {
        let mut p = topk::TopkParams::new(vocab, k, 4).unwrap();
        p.row_stride = stride;
        let cb = gpu
            .buffer_zeroed("candidates", u64::from(rows * p.candidates()) * 8)
            .unwrap();
        let rb = gpu.buffer_zeroed("result", u64::from(rows * k) * 8).unwrap();
        let mut rec = gpu.recorder();
        topk::record_rows(gpu, &mut rec, &p, rows, &lb, &cb, &rb).unwrap();
        rec.submit().unwrap();
        let got: Vec<topk::IdLogit> =
            bytemuck::pod_collect_to_vec(&gpu.read_bytes(&rb, 0, u64::from(rows * k) * 8).unwrap());
        for r in 0..rows as usize {
            let start = 4 + r * stride as usize;
            let want = topk::reference::top_k(&logits[start..start + vocab as usize], k as usize);
            assert_eq!(
                got[r * k as usize..(r + 1) * k as usize],
                want[..],
                "row {r}, k = {k}"
            );
        }
    }
}

#[test]
fn gpu_elementwise_matches_reference() {
    use elementwise::{EwArgs, EwKind, EwParams};
    let Some(gpu) = test_gpu(false) else { return };
    let mut rng = Rng::new(4);
    // 3 rows of 70 with padded strides; moe_combine over 4 experts, accumulated into out.
    let (rows, n, experts) = (3u32, 70u32, 4u32);
    let a = rng.vec((rows * (experts * n + 3)) as usize, 2.0);
    let b = rng.vec((rows * 75) as usize, 2.0);
    let w = rng.vec((rows * experts) as usize, 1.0);
    let g = rng.vec(rows as usize, 2.0);
    let out0 = rng.vec((rows * n) as usize, 1.0);
    let (ab, bb, wb, gb) = (
        upload(gpu, "a", &a),
        upload(gpu, "b", &b),
        upload(gpu, "w", &w),
        upload(gpu, "g", &g),
    );
    for kind in [
        EwKind::SiluMul,
        EwKind::Add,
        EwKind::MulSigmoid,
        EwKind::CopyRows,
        EwKind::MoeCombine,
        EwKind::MoeSum,
    ] {
        let p = EwParams {
            a_offset: 1,
            a_stride: experts * n + 3,
            b_offset: 2,
            b_stride: 75,
            weights_stride: experts,
            experts,
            accumulate: 1,
            gate_stride: 1,
            ..EwParams::packed(rows, n)
        };
        let ob = upload(gpu, "out", &out0);
        let mut rec = gpu.recorder();
        let args = EwArgs {
            a: &ab,
            b: Some(&bb),
            out: &ob,
            weights: Some(&wb),
            gate: Some(&gb),
        };
        elementwise::record(gpu, &mut rec, kind, &p, &args).unwrap();
        rec.submit().unwrap();
        let mut want = out0.clone();
        elementwise::reference::run(kind, &p, &a, &b, &w, &g, &mut want);
        // A few f32 operations (exp, 4-term sums) against f64.
        let d = max_abs_diff(&download(gpu, &ob, want.len()), &want);
        assert!(d < 1e-5, "{kind:?}: max abs diff {d}");
    }
}

/// Wall time per call of `record` over `reps` calls recorded into one submit (after a warm-up
/// submit that builds the pipelines), in microseconds.
fn time_per_call(gpu: &Gpu, reps: u32, mut record: impl FnMut(&mut qk::gpu::Recorder<'_>)) -> f64 {
    let mut warm = gpu.recorder();
    record(&mut warm);
    warm.submit().unwrap();
    gpu.wait().unwrap();
    let start = std::time::Instant::now();
    let mut rec = gpu.recorder();
    for _ in 0..reps {
        record(&mut rec);
    }
    rec.submit().unwrap();
    gpu.wait().unwrap();
    start.elapsed().as_secs_f64() * 1e6 / reps as f64
}

/// Timings of the kernels at Qwen3-Next shapes (nk 16 / nv 32 / dk = dv 128,
/// conv 8192 x 4, 512 experts top-10, vocabulary 151936). Too slow for lavapipe; run on a real GPU
/// with `cargo test --test rust -- --ignored bench_ops --nocapture`. It checks that outputs stay
/// finite; the numbers are for reading.
#[test]
#[ignore = "timing at real model shapes; for a real GPU"]
fn bench_ops_real_shapes() {
    let Some(gpu) = test_gpu(false) else { return };
    let mut rng = Rng::new(99);
    // QK_BENCH_REPS lowers the repetitions (lavapipe needs minutes at 50).
    let reps: u32 = std::env::var("QK_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let few = reps.div_ceil(10);
    eprintln!(
        "{} (subgroup size {}):",
        gpu.adapter.name, gpu.caps.subgroup_max_size
    );
    let report = |line: String| eprintln!("  {line}");

    // DeltaNet: recurrent decode step and chunked prefill of 512 tokens.
    let case = DeltaCase::new(5, 512, 16, 32, 128, 128, deltanet::HeadPairing::Grouped);
    let bufs = DeltaGpu::new(gpu, &case);
    let one = deltanet::DeltaParams {
        tokens: 1,
        ..case.params
    };
    let us = time_per_call(gpu, reps, |rec| {
        deltanet::record_recurrent(gpu, rec, &one, &bufs.args()).unwrap()
    });
    report(format!("deltanet recurrent 1 token: {us:.1} us"));
    let us = time_per_call(gpu, few, |rec| {
        deltanet::record_chunked(gpu, rec, &case.params, &bufs.args()).unwrap()
    });
    report(format!("deltanet chunked 512 tokens: {us:.1} us"));
    let out_d = download(gpu, &bufs.out, case.out_len());
    assert!(out_d.iter().all(|x| x.is_finite()), "deltanet outputs not finite");

    // Conv over 8192 channels, one token.
    let cw = upload(gpu, "cw", &rng.vec(8192 * 4, 0.5));
    let cs = gpu.buffer_zeroed("cs", 8192 * 3 * 4).unwrap();
    let cx = upload(gpu, "cx", &rng.vec(8192, 1.0));
    let cy = gpu.buffer_zeroed("cy", 8192 * 4).unwrap();
    let cp = conv::ConvParams {
        tokens: 1,
        channels: 8192,
        taps: 4,
        src_offset: 0,
        src_token_stride: 8192,
        dst_offset: 0,
        dst_token_stride: 8192,
        state_offset: 0,
    };
    let us = time_per_call(gpu, reps, |rec| {
        conv::record(gpu, rec, &cp, &cx, &cw, &cs, &cy).unwrap()
    });
    report(format!("conv 8192 channels 1 token: {us:.1} us"));

    // RMSNorm of one 2048 row.
    let x = upload(gpu, "x", &rng.vec(2048, 1.0));
    let w = upload(gpu, "w", &rng.vec(2048, 1.0));
    let y = gpu.buffer_zeroed("y", 2048 * 4).unwrap();
    let np = norm::NormParams::new(
        1,
        1,
        2048,
        norm::RowLayout::packed(2048, 1),
        norm::RowLayout::packed(2048, 1),
        1e-6,
        1.0,
    );
    let nargs = norm::NormArgs {
        src: &x,
        dst: &y,
        weight: Some(&w),
        other: None,
        sum: None,
    };
    let us = time_per_call(gpu, reps, |rec| {
        norm::record(gpu, rec, norm::NormKind::Rms, &np, &nargs).unwrap()
    });
    report(format!("rms norm 2048: {us:.1} us"));

    // Router 512 experts top-10.
    let rl = upload(gpu, "rl", &rng.vec(512, 3.0));
    let (ri, rw) = (
        gpu.buffer_zeroed("ri", 40).unwrap(),
        gpu.buffer_zeroed("rw", 40).unwrap(),
    );
    let rp = router::RouterParams {
        tokens: 1,
        experts: 512,
        k: 10,
        logits_offset: 0,
        logits_token_stride: 512,
    };
    let us = time_per_call(gpu, reps, |rec| {
        router::record(gpu, rec, &rp, &rl, &ri, &rw).unwrap()
    });
    report(format!("router 512 top-10: {us:.1} us"));

    // Top-k over the Qwen3-Next vocabulary.
    let logits = upload(gpu, "logits", &rng.vec(151_936, 10.0));
    for kk in [1u32, 256] {
        let tp = topk::TopkParams::new(151_936, kk, 0).unwrap();
        let cb = gpu.buffer_zeroed("cand", tp.candidates() as u64 * 8).unwrap();
        let rb = gpu.buffer_zeroed("res", kk as u64 * 8).unwrap();
        let us = time_per_call(gpu, few, |rec| {
            topk::record(gpu, rec, &tp, &logits, &cb, &rb).unwrap()
        });
        report(format!("top-{kk} of 151936: {us:.1} us"));
    }
}
