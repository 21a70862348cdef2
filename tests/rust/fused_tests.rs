//! The decode step's fused mat-vec stages against CPU references: the RMSNorm folded into the
//! product (and the stored normalised input), the residual add, the GDN conv epilogue with its slot
//! states, the silu·mul input of the expert down projection, and the expert products summed over a
//! token's picks into the residual stream.
//!
//! Tolerance: the GPU computes the same f32 products as the reference in another order, so the NMSE
//! bound of the plain mat-vec tests (1e-9) applies; the norm adds one f32 rounding per input.

use qk::gguf::GgmlType;
use qk::gguf::dequant::dequantize;
use qk::gpu::{Gpu, GpuBuffer, WeightTensor};
use qk::ops::matmul::{
    Columns, ExpertIds, Iq4Lookup, MatvecFusion, MatvecInput, MatvecOutput, MatvecShape, MoeInput,
    expert_shape, matvec_fused, matvec_id_sum, matvec_id_with,
};

use crate::gpu_tests::{same_bits, test_gpu};
use crate::matmul_tests::{Rng, nmse, random_weights};

const NMSE_MAX: f64 = 1e-9;
const EPS: f32 = 1e-6;

fn upload(
    gpu: &Gpu,
    ty: GgmlType,
    m: usize,
    k: usize,
    experts: usize,
    seed: u64,
) -> (WeightTensor, Vec<f32>) {
    let mut rng = Rng(seed);
    let bytes = random_weights(ty, m * k * experts, &mut rng);
    let dense = dequantize(ty, &bytes, m * k * experts).expect("reference dequant");
    let w = gpu
        .upload_weight("w", ty, k as u64, m as u64, experts as u64, &bytes)
        .expect("upload");
    (w, dense)
}

fn floats(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = Rng(seed);
    (0..n).map(|_| rng.f32() * scale).collect()
}

fn dot(w: &[f32], x: &[f64]) -> f64 {
    w.iter().zip(x).map(|(&a, &b)| f64::from(a) * b).sum()
}

fn read(gpu: &Gpu, buf: &GpuBuffer, n: usize) -> Vec<f32> {
    gpu.read_f32(buf, 0, n).expect("read")
}

/// silu(gate) · up of one gate ‖ up column (2k floats), in f64.
fn silu_mul_column(row: &[f32], k: usize) -> Vec<f64> {
    (0..k)
        .map(|i| {
            let g = f64::from(row[i]);
            g / (1.0 + (-g).exp()) * f64::from(row[k + i])
        })
        .collect()
}

/// RMSNorm of each column (f64), as the fused stage defines it.
fn normed(x: &[f32], w: &[f32], k: usize) -> Vec<f64> {
    x.chunks(k)
        .flat_map(|col| {
            let ms: f64 = col.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / k as f64;
            let inv = 1.0 / (ms + f64::from(EPS)).sqrt();
            col.iter()
                .zip(w)
                .map(move |(&v, &g)| f64::from(v) * inv * f64::from(g))
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn fused_norm_then_matvec_every_word_path_and_stored_input() {
    // The kernel sums the squares from the products' own loads and scales the finished sums; with
    // the normalised input stored (the router's case) each workgroup also writes its slice of it
    // once its sums are reduced (37 rows: more workgroups than some columns have slices). Every
    // word path, with and without the store.
    let Some(gpu) = test_gpu(false) else { return };
    let (m, k) = (37, 512);
    for (i, ty) in [
        GgmlType::IQ4XS,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q6K,
        GgmlType::Q5K,
        GgmlType::F32,
    ]
    .into_iter()
    .enumerate()
    {
        let (w, dense) = upload(gpu, ty, m, k, 1, 11 + i as u64);
        // 8 columns: the shapes that take 8 rows per workgroup (37 rows: a partial last group).
        for (cols, stored) in [1usize, 3, 8].into_iter().flat_map(|c| [(c, true), (c, false)]) {
            // Large activations: the norm must undo their scale.
            let x = floats(k * cols, 5 + cols as u64, 40.0);
            let g = floats(k, 9, 1.0);
            let xb = gpu.buffer_from_f32("x", &x).unwrap();
            let gb = gpu.buffer_from_f32("g", &g).unwrap();
            let yb = gpu.buffer_zeroed("y", (m * cols * 4) as u64).unwrap();
            let xn = gpu.buffer_zeroed("xn", (k * cols * 4) as u64).unwrap();
            let fusion = MatvecFusion {
                input: MatvecInput::Rms {
                    weight: &gb,
                    eps: EPS,
                    store: stored.then_some(&xn),
                },
                output: MatvecOutput::Store,
            };
            let mut rec = gpu.recorder();
            let (xc, yc) = (Columns::packed(&xb, k as u32), Columns::packed(&yb, m as u32));
            matvec_fused(gpu, &mut rec, &w, xc, yc, cols as u32, &fusion).unwrap();
            rec.submit().unwrap();
            let xr = normed(&x, &g, k);
            let want: Vec<f64> = (0..cols)
                .flat_map(|c| {
                    (0..m)
                        .map(|r| dot(&dense[r * k..(r + 1) * k], &xr[c * k..(c + 1) * k]))
                        .collect::<Vec<_>>()
                })
                .collect();
            let e = nmse(&read(gpu, &yb, m * cols), &want);
            assert!(e < NMSE_MAX, "{ty} cols {cols} stored {stored}: NMSE {e:e}");
            if stored {
                let e = nmse(&read(gpu, &xn, k * cols), &xr);
                assert!(e < 1e-12, "{ty} cols {cols}: stored input NMSE {e:e}");
            }
        }
    }
}

#[test]
fn fused_residual_add() {
    let Some(gpu) = test_gpu(false) else { return };
    let (m, k) = (64, 256);
    let (w, dense) = upload(gpu, GgmlType::IQ4XS, m, k, 1, 3);
    for cols in [2usize, 6] {
        let x = floats(k * cols, 1, 1.0);
        let res = floats(m * cols, 2, 3.0);
        let xb = gpu.buffer_from_f32("x", &x).unwrap();
        let rb = gpu.buffer_from_f32("res", &res).unwrap();
        let yb = gpu.buffer_zeroed("y", (m * cols * 4) as u64).unwrap();
        let fusion = MatvecFusion {
            input: MatvecInput::Plain,
            output: MatvecOutput::AddTo { residual: &rb },
        };
        let mut rec = gpu.recorder();
        let (xc, yc) = (Columns::packed(&xb, k as u32), Columns::packed(&yb, m as u32));
        matvec_fused(gpu, &mut rec, &w, xc, yc, cols as u32, &fusion).unwrap();
        rec.submit().unwrap();
        let want: Vec<f64> = (0..cols * m)
            .map(|i| {
                let (c, r) = (i / m, i % m);
                let xc: Vec<f64> = x[c * k..(c + 1) * k].iter().map(|&v| f64::from(v)).collect();
                f64::from(res[i]) + dot(&dense[r * k..(r + 1) * k], &xc)
            })
            .collect();
        let e = nmse(&read(gpu, &yb, m * cols), &want);
        assert!(e < NMSE_MAX, "{cols} columns: NMSE {e:e}");
    }
}

/// The conv epilogue over the first `channels` rows, column c on slot `slots[c]`, each slot's state
/// (taps − 1) · channels floats.
fn conv_output<'a>(
    weights: &'a GpuBuffer,
    state: &'a GpuBuffer,
    slots: &'a GpuBuffer,
    channels: usize,
    taps: usize,
) -> MatvecOutput<'a> {
    MatvecOutput::Conv {
        weights,
        state,
        slots,
        slots_offset: 0,
        channels: channels as u32,
        taps: taps as u32,
        state_stride: ((taps - 1) * channels) as u32,
    }
}

#[test]
fn fused_conv_advances_each_columns_slot_state() {
    let Some(gpu) = test_gpu(false) else { return };
    // 40 conv channels of 48 rows; columns 0 and 1 are slots 2 and 0 of three.
    let (m, k, channels, taps, cols, n_slots) = (48usize, 256usize, 40usize, 4usize, 2usize, 3usize);
    let hist = taps - 1;
    let stride = hist * channels;
    let (w, dense) = upload(gpu, GgmlType::Q8_0, m, k, 1, 21);
    let cw = floats(channels * taps, 4, 1.0);
    let mut state = floats(n_slots * stride, 6, 1.0);
    let slots = [2u32, 0];
    let cwb = gpu.buffer_from_f32("cw", &cw).unwrap();
    let sb = gpu.buffer_from_f32("state", &state).unwrap();
    let slb = gpu.buffer_from_u32("slots", &slots).unwrap();
    let yb = gpu.buffer_zeroed("y", (m * cols * 4) as u64).unwrap();
    for step in 0..2u64 {
        let x = floats(k * cols, 30 + step, 1.0);
        let xb = gpu.buffer_from_f32("x", &x).unwrap();
        let fusion = MatvecFusion {
            input: MatvecInput::Plain,
            output: conv_output(&cwb, &sb, &slb, channels, taps),
        };
        let mut rec = gpu.recorder();
        let (xc, yc) = (Columns::packed(&xb, k as u32), Columns::packed(&yb, m as u32));
        matvec_fused(gpu, &mut rec, &w, xc, yc, cols as u32, &fusion).unwrap();
        rec.submit().unwrap();
        let mut want = vec![0f64; m * cols];
        for c in 0..cols {
            let xc: Vec<f64> = x[c * k..(c + 1) * k].iter().map(|&v| f64::from(v)).collect();
            let base = slots[c] as usize * stride;
            for r in 0..m {
                let y = dot(&dense[r * k..(r + 1) * k], &xc);
                want[c * m + r] = if r < channels {
                    let mut acc = f64::from(cw[r * taps + hist]) * y;
                    for j in 0..hist {
                        acc += f64::from(cw[r * taps + j]) * f64::from(state[base + j * channels + r]);
                    }
                    // The state shifts by one input; the oldest falls out.
                    for j in 0..hist - 1 {
                        state[base + j * channels + r] = state[base + (j + 1) * channels + r];
                    }
                    state[base + (hist - 1) * channels + r] = y as f32;
                    acc / (1.0 + (-acc).exp())
                } else {
                    y
                };
            }
        }
        let e = nmse(&read(gpu, &yb, m * cols), &want);
        assert!(e < NMSE_MAX, "step {step}: NMSE {e:e}");
        let got_state = read(gpu, &sb, n_slots * stride);
        let want_state: Vec<f64> = state.iter().map(|&v| f64::from(v)).collect();
        let e = nmse(&got_state, &want_state);
        assert!(e < NMSE_MAX, "step {step}: state NMSE {e:e}");
        // Slot 1 is in no column: untouched, bit for bit.
        assert_eq!(got_state[stride..2 * stride], state[stride..2 * stride]);
    }
}

#[test]
fn f32_rows_ride_in_the_normed_conv_product_without_changing_it() {
    // The decode step's beta/alpha (F32) computed by extra workgroups of the q‖k‖v‖z product: the
    // product's own rows and conv states keep their bytes, and the extra rows are the F32 matrix
    // times the same normalised input, stored after them. 3 columns on slots 1, 0, 2.
    use qk::ops::matmul::matvec_shaped;
    let Some(gpu) = test_gpu(false) else { return };
    let (m, k, extra, channels, taps, cols) = (48usize, 256usize, 10usize, 40usize, 4usize, 3usize);
    let stride = (taps - 1) * channels;
    let (w, _) = upload(gpu, GgmlType::IQ4XS, m, k, 1, 23);
    let (ba, ba_dense) = upload(gpu, GgmlType::F32, extra, k, 1, 24);
    let cwb = gpu
        .buffer_from_f32("cw", &floats(channels * taps, 4, 1.0))
        .unwrap();
    let state = floats(3 * stride, 6, 1.0);
    let slb = gpu.buffer_from_u32("slots", &[1, 0, 2]).unwrap();
    let norm_w = floats(k, 5, 1.0);
    let nb = gpu.buffer_from_f32("norm", &norm_w).unwrap();
    let x = floats(k * cols, 30, 1.0);
    let xb = gpu.buffer_from_f32("x", &x).unwrap();
    // Output columns of m + extra + 2 floats (the pad stays zero).
    let width = m + extra + 2;
    let run = |with_extra: bool| {
        let sb = gpu.buffer_from_f32("state", &state).unwrap();
        let yb = gpu.buffer_zeroed("y", (width * cols * 4) as u64).unwrap();
        let fusion = MatvecFusion {
            input: MatvecInput::Rms {
                weight: &nb,
                eps: EPS,
                store: None,
            },
            output: conv_output(&cwb, &sb, &slb, channels, taps),
        };
        let mut rec = gpu.recorder();
        let (xc, yc) = (Columns::packed(&xb, k as u32), Columns::packed(&yb, width as u32));
        let extra = with_extra.then_some(&ba);
        matvec_shaped(gpu, &mut rec, &w, extra, xc, yc, cols as u32, &fusion, None).unwrap();
        rec.submit().unwrap();
        (read(gpu, &yb, width * cols), read(gpu, &sb, 3 * stride))
    };
    let (y0, state0) = run(false);
    let (y1, state1) = run(true);
    for c in 0..cols {
        let col = c * width;
        assert!(
            same_bits(&y0[col..col + m], &y1[col..col + m]),
            "column {c}: rows changed"
        );
        assert_eq!(
            y1[col + m + extra..col + width],
            [0.0, 0.0],
            "column {c}: wrote past the rows"
        );
        let xn = normed(&x[c * k..(c + 1) * k], &norm_w, k);
        let want: Vec<f64> = (0..extra)
            .map(|r| dot(&ba_dense[r * k..(r + 1) * k], &xn))
            .collect();
        let e = nmse(&y1[col + m..col + m + extra], &want);
        assert!(e < NMSE_MAX, "column {c}: extra rows NMSE {e:e}");
    }
    assert!(same_bits(&state0, &state1), "conv states changed");
}

#[test]
fn expert_down_reads_silu_of_gate_times_up() {
    let Some(gpu) = test_gpu(false) else { return };
    // Down projection of 3 experts (m = 64 out, k = 256 ff) over 2 tokens × 2 used: the input
    // of slot s is silu(gate) · up from a gate ‖ up row of 2k floats.
    let (m, k, experts, n_used, tokens) = (64usize, 256usize, 3usize, 2usize, 2usize);
    let (w, dense) = upload(gpu, GgmlType::Q4K, m, k, experts, 8);
    let gu = floats(2 * k * n_used * tokens, 12, 2.0);
    let ids = [2u32, 0, 1, 2];
    let gub = gpu.buffer_from_f32("gate_up", &gu).unwrap();
    let idb = gpu.buffer_from_u32("ids", &ids).unwrap();
    let mut want = Vec::new();
    for (col, &e) in ids.iter().enumerate() {
        let act = silu_mul_column(&gu[col * 2 * k..(col + 1) * 2 * k], k);
        let we = &dense[e as usize * m * k..(e as usize + 1) * m * k];
        want.extend((0..m).map(|r| dot(&we[r * k..(r + 1) * k], &act)));
    }
    // The default shape and the largest row group the shader takes.
    let big = MatvecShape::new(16, 32, 1);
    for shape in [None, Some(big)] {
        let yb = gpu.buffer_zeroed("y", (m * n_used * tokens * 4) as u64).unwrap();
        let mut rec = gpu.recorder();
        matvec_id_with(
            gpu,
            &mut rec,
            &w,
            Columns::packed(&gub, 2 * k as u32),
            Columns::packed(&yb, m as u32),
            ExpertIds {
                buf: &idb,
                offset: 0,
                n_used: n_used as u32,
                n_tokens: tokens as u32,
            },
            MoeInput::PerSlot,
            MatvecInput::SiluMul { up: k as u32 },
            shape,
        )
        .unwrap();
        rec.submit().unwrap();
        let e = nmse(&read(gpu, &yb, m * n_used * tokens), &want);
        assert!(e < NMSE_MAX, "{shape:?}: NMSE {e:e}");
    }
}

#[test]
fn expert_sum_adds_every_picks_weighted_product_to_the_residual() {
    let Some(gpu) = test_gpu(false) else { return };
    // 37 output rows (a partial last row group), K = 512 ff, 4 experts, 3 picks per token over 3
    // tokens; token 1's second pick is an id outside the stack, which must contribute nothing.
    let (m, k, experts, n_used, tokens) = (37usize, 512usize, 4usize, 3usize, 3usize);
    let ids = [3u32, 0, 1, 2, 9, 0, 1, 1, 3];
    let weights = [0.5f32, 0.25, 1.5, -0.75, 2.0, 0.125, 1.0, 0.5, -1.25];
    let shapes = [
        None,
        Some(MatvecShape::new(1, 32, 1)),
        // Two live steps per loop iteration that fall in different picks.
        Some(MatvecShape::new(8, 64, 2)),
        Some(MatvecShape::new(4, 256, 2)),
        // The largest row group: 37 rows end inside the third.
        Some(MatvecShape::new(16, 128, 1)),
        // IQ4_XS values from subgroup shuffles (a table elsewhere), with 32 of the 128 invocations
        // past the last step.
        Some(expert_shape(GgmlType::IQ4XS, true).with_lookup(Iq4Lookup::Shuffle)),
    ];
    for (i, ty) in [
        GgmlType::IQ4XS,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q6K,
        GgmlType::Q5K,
    ]
    .into_iter()
    .enumerate()
    {
        let (w, dense) = upload(gpu, ty, m, k, experts, 40 + i as u64);
        let gu = floats(2 * k * n_used * tokens, 41 + i as u64, 2.0);
        let res = floats(m * tokens, 42, 3.0);
        let gub = gpu.buffer_from_f32("gate_up", &gu).unwrap();
        let idb = gpu.buffer_from_u32("ids", &ids).unwrap();
        let wb = gpu.buffer_from_f32("weights", &weights).unwrap();
        let mut want: Vec<f64> = res.iter().map(|&v| f64::from(v)).collect();
        for (slot, (&e, &wt)) in ids.iter().zip(&weights).enumerate() {
            if e as usize >= experts {
                continue;
            }
            let act = silu_mul_column(&gu[slot * 2 * k..(slot + 1) * 2 * k], k);
            let we = &dense[e as usize * m * k..(e as usize + 1) * m * k];
            let t = slot / n_used;
            for r in 0..m {
                want[t * m + r] += f64::from(wt) * dot(&we[r * k..(r + 1) * k], &act);
            }
        }
        let mut table_sum = Vec::new();
        for shape in shapes {
            let run = |first: usize, count: usize| {
                let yb = gpu
                    .buffer_from_f32("y", &res[first * m..(first + count) * m])
                    .unwrap();
                let mut rec = gpu.recorder();
                let (gc, yc) = (
                    Columns::packed(&gub, 2 * k as u32),
                    Columns::packed(&yb, m as u32),
                );
                let ids = ExpertIds {
                    buf: &idb,
                    offset: (first * n_used) as u32,
                    n_used: n_used as u32,
                    n_tokens: count as u32,
                };
                let gc = Columns {
                    offset: gc.offset + (first * n_used * 2 * k) as u32,
                    ..gc
                };
                let silu_mul = MatvecInput::SiluMul { up: k as u32 };
                matvec_id_sum(gpu, &mut rec, &w, gc, yc, ids, &wb, silu_mul, shape).unwrap();
                rec.submit().unwrap();
                read(gpu, &yb, count * m)
            };
            let got = run(0, tokens);
            let e = nmse(&got, &want);
            assert!(e < NMSE_MAX, "{ty} {shape:?}: NMSE {e:e}");
            // A token's sum does not depend on the batch around it.
            assert_eq!(run(1, 1), got[m..2 * m], "{ty} {shape:?}: token 1 alone");
            let default = expert_shape(ty, true);
            if let Some(sh) = shape.filter(|sh| sh.wg == default.wg && sh.unroll == default.unroll) {
                // Another row count, or the same values found another way (shuffles): at the
                // default's width and unroll, the default's bytes (what lets a launch shape
                // depend on the batch without a row's sum doing so).
                assert!(
                    same_bits(&got, &table_sum),
                    "{ty} {sh:?}: {:?} lookup differs from the default",
                    sh.lookup.effective(gpu, ty, sh.wg)
                );
            }
            if shape.is_none() {
                table_sum = got;
            }
        }
    }
}

#[test]
fn router_appends_the_shared_expert_as_the_last_pick() {
    use qk::ops::router::{self, RouterParams, SharedSlot};
    for no_subgroups in [false, true] {
        let Some(gpu) = test_gpu(no_subgroups) else { return };
        // 2 tokens, 512 experts + the shared gate logit at column 512 of rows of 513 (the stacked
        // router's layout), top-10 plus the shared slot.
        let (tokens, experts, k) = (2u32, 512u32, 10u32);
        let stride = experts + 1;
        let logits = floats((tokens * stride) as usize, 77, 3.0);
        let p = RouterParams {
            tokens,
            experts,
            k,
            logits_offset: 0,
            logits_token_stride: stride,
        };
        let lb = gpu.buffer_from_f32("logits", &logits).unwrap();
        let n = (tokens * (k + 1)) as usize;
        let ib = gpu.buffer_zeroed("ids", n as u64 * 4).unwrap();
        let wb = gpu.buffer_zeroed("weights", n as u64 * 4).unwrap();
        let shared = SharedSlot {
            id: experts,
            gate: &lb,
            gate_offset: experts,
            gate_stride: stride,
        };
        let mut rec = gpu.recorder();
        router::record_with(gpu, &mut rec, &p, &lb, &ib, &wb, Some(shared)).unwrap();
        rec.submit().unwrap();
        let (ids, weights) = router::reference::route(&p, &logits);
        let got_ids = gpu.read_u32(&ib, 0, n).unwrap();
        let got_w = read(gpu, &wb, n);
        for t in 0..tokens as usize {
            let row = t * (k as usize + 1);
            let (want_ids, want_w) = (
                &ids[t * k as usize..][..k as usize],
                &weights[t * k as usize..][..k as usize],
            );
            assert_eq!(
                &got_ids[row..row + k as usize],
                want_ids,
                "token {t}, subgroups off: {no_subgroups}"
            );
            assert_eq!(got_ids[row + k as usize], experts);
            for (g, w) in got_w[row..row + k as usize].iter().zip(want_w) {
                assert!((g - w).abs() < 1e-6, "token {t}: weight {g} vs {w}");
            }
            let gate = f64::from(logits[t * stride as usize + experts as usize]);
            let sig = 1.0 / (1.0 + (-gate).exp());
            assert!((f64::from(got_w[row + k as usize]) - sig).abs() < 1e-6);
        }
    }
}

#[test]
fn gdn_step_then_head_norm_projection_match_the_recurrent_reference_per_slot() {
    // The decode step's GDN path: the step (delta rule + gate, a head's columns over several
    // workgroups) and the output projection that finishes the gated norm from the step's sums of
    // squares and adds the residual. Subgroups on: a column shared by a subgroup's lanes; off: one
    // invocation per column.
    // With subgroups, other spreads of a head's columns (invocations per workgroup, columns per
    // invocation) too; without, an invocation holds a whole column whatever the shape.
    use qk::ops::gdn_step::GdnStepShape;
    let others = [(64, 4), (64, 1)].map(|(max_wg, columns)| GdnStepShape { max_wg, columns });
    for no_subgroups in [false, true] {
        if let Some(gpu) = test_gpu(no_subgroups) {
            let mut outputs = Vec::new();
            for shape in [GdnStepShape::ONE_ROW, GdnStepShape::ROWS] {
                outputs.push(gdn_step_case(gpu, shape));
            }
            // The two shapes `record` picks (one row, several) have the same bytes: a row's result
            // does not depend on the batch.
            assert!(
                outputs[0]
                    .iter()
                    .zip(&outputs[1])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "the one-row and the several-row shapes differ"
            );
            for shape in others.into_iter().filter(|_| !no_subgroups) {
                gdn_step_case(gpu, shape);
            }
        }
    }
}

/// The step at `shape` against the recurrent reference; returns what it wrote (outputs, sums of
/// squares and states of both steps, the projection's results).
fn gdn_step_case(gpu: &Gpu, shape: qk::ops::gdn_step::GdnStepShape) -> Vec<f32> {
    use qk::ops::deltanet::{DeltaParams, reference};
    use qk::ops::gdn_step::{GdnStepArgs, GdnStepParams, record_shaped};
    // qwen3next grouping: 2 k-heads, 4 v-heads, dk = dv = 64; 3 rows on slots 1, 3, 0 of 4; two steps.
    let (nk, nv, dk, dv, rows, n_slots) = (2u32, 4u32, 64u32, 64u32, 3u32, 4u32);
    let (key_dim, vd) = (nk * dk, nv * dv);
    let cd = 2 * key_dim + vd;
    let (bstride, zstride) = (cd + 2 * nv, vd);
    let r = nv / nk;
    let parts = shape.parts(gpu, dv);
    // The output projection: 40 rows of IQ4_XS over the vd gated values, a residual beside it.
    let m = 40usize;
    let (w, dense) = upload(gpu, GgmlType::IQ4XS, m, vd as usize, 1, 7);
    let p = GdnStepParams {
        rows,
        k_heads: nk,
        v_heads: nv,
        dk,
        dv,
        pairing: 0,
        qkv_offset: 0,
        qkv_stride: bstride,
        q_offset: 0,
        k_offset: key_dim,
        v_offset: 2 * key_dim,
        ba_offset: 0,
        ba_stride: bstride,
        ba_group: r,
        ba_group_stride: 2 * r,
        beta_offset: cd,
        alpha_offset: cd + r,
        z_offset: 0,
        z_stride: zstride,
        out_offset: 0,
        out_stride: vd,
        state_stride: vd * dk,
        slots_offset: 1,
        parts: 0,
        sq_offset: 3,
        sq_stride: nv * parts + 5,
        eps: 1e-6,
        q_scale: 1.0 / (dk as f32).sqrt(),
    };
    let slots = [9u32, 1, 3, 0];
    let ssm_a = floats(nv as usize, 3, 1.0)
        .iter()
        .map(|v| -v.abs() - 0.1)
        .collect::<Vec<_>>();
    let dt_bias = floats(nv as usize, 4, 1.0);
    let norm = floats(dv as usize, 5, 1.0);
    let mut state = floats((n_slots * vd * dk) as usize, 6, 0.1);
    let sb = gpu.buffer_from_f32("state", &state).unwrap();
    let (ab, db, nb) = (
        gpu.buffer_from_f32("a", &ssm_a).unwrap(),
        gpu.buffer_from_f32("dt", &dt_bias).unwrap(),
        gpu.buffer_from_f32("norm", &norm).unwrap(),
    );
    let slb = gpu.buffer_from_u32("slots", &slots).unwrap();
    let ob = gpu.buffer_zeroed("out", u64::from(rows * vd) * 4).unwrap();
    let sqb = gpu
        .buffer_zeroed("sums", u64::from(3 + rows * p.sq_stride) * 4)
        .unwrap();
    let res = floats(rows as usize * m, 8, 1.0);
    let resb = gpu.buffer_from_f32("res", &res).unwrap();
    let yb = gpu.buffer_zeroed("y", (rows as usize * m * 4) as u64).unwrap();
    let mut written = Vec::new();
    for step in 0..2u64 {
        let qkv = floats((rows * bstride) as usize, 10 + step, 1.0);
        let z = floats((rows * zstride) as usize, 20 + step, 2.0);
        let (qb, zb) = (
            gpu.buffer_from_f32("qkv", &qkv).unwrap(),
            gpu.buffer_from_f32("z", &z).unwrap(),
        );
        let mut rec = gpu.recorder();
        let args = GdnStepArgs {
            qkv: &qb,
            ba: &qb,
            ssm_a: &ab,
            dt_bias: &db,
            z: &zb,
            norm: &nb,
            sq: &sqb,
            slots: &slb,
            state: &sb,
            out: &ob,
        };
        record_shaped(gpu, &mut rec, &p, &args, shape).unwrap();
        let fusion = MatvecFusion {
            input: MatvecInput::HeadRms {
                sums: &sqb,
                heads: nv,
                head_dim: dv,
                parts,
                offset: p.sq_offset,
                stride: p.sq_stride,
                eps: 1e-6,
            },
            output: MatvecOutput::AddTo { residual: &resb },
        };
        let (xc, yc) = (Columns::packed(&ob, vd), Columns::packed(&yb, m as u32));
        matvec_fused(gpu, &mut rec, &w, xc, yc, rows, &fusion).unwrap();
        rec.submit().unwrap();
        let mut want = vec![0f64; (rows * vd) as usize];
        for row in 0..rows as usize {
            let slot = slots[1 + row] as usize;
            let dp = DeltaParams {
                tokens: 1,
                k_heads: nk,
                v_heads: nv,
                dk,
                dv,
                pairing: 0,
                first_token: row as u32,
                chunks: 0,
                qkv_token_stride: bstride,
                q_offset: 0,
                k_offset: key_dim,
                v_offset: 2 * key_dim,
                ba_token_stride: bstride,
                ba_group: r,
                ba_group_stride: 2 * r,
                beta_offset: cd,
                alpha_offset: cd + r,
                out_offset: 0,
                out_token_stride: vd,
                state_offset: slot as u32 * vd * dk,
                eps: 1e-6,
                q_scale: p.q_scale,
                _pad0: 0,
                _pad1: 0,
            };
            let mut o = vec![0f32; (rows * vd) as usize];
            reference::recurrent(&dp, &qkv, &qkv, &ssm_a, &dt_bias, &mut state, &mut o);
            for n in 0..nv as usize {
                let head = &o[row * vd as usize + n * dv as usize..][..dv as usize];
                let ms = head.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / f64::from(dv);
                let inv = 1.0 / (ms + 1e-6).sqrt();
                for j in 0..dv as usize {
                    let zj = f64::from(z[row * zstride as usize + n * dv as usize + j]);
                    want[row * vd as usize + n * dv as usize + j] =
                        f64::from(head[j]) * inv * f64::from(norm[j]) * zj / (1.0 + (-zj).exp());
                }
            }
        }
        // f32 against the f64 recurrence over 64-long dot products, a norm and a 256-long product:
        // ~1e-12 NMSE.
        let want_y: Vec<f64> = (0..rows as usize * m)
            .map(|i| {
                let (c, row) = (i / m, i % m);
                let x = &want[c * vd as usize..][..vd as usize];
                f64::from(res[i]) + dot(&dense[row * vd as usize..][..vd as usize], x)
            })
            .collect();
        let e = nmse(&read(gpu, &yb, rows as usize * m), &want_y);
        assert!(e < NMSE_MAX, "{shape:?} step {step}: projected output NMSE {e:e}");
        let want_state: Vec<f64> = state.iter().map(|&v| f64::from(v)).collect();
        let e = nmse(&read(gpu, &sb, state.len()), &want_state);
        assert!(e < NMSE_MAX, "{shape:?} step {step}: state NMSE {e:e}");
        for (buf, len) in [
            (&ob, rows * vd),
            (&sqb, 3 + rows * p.sq_stride),
            (&sb, n_slots * vd * dk),
        ] {
            written.extend(read(gpu, buf, len as usize));
        }
        written.extend(read(gpu, &yb, rows as usize * m));
    }
    written
}

#[test]
fn routing_inside_the_expert_product_matches_the_router_then_the_product() {
    use qk::ops::matmul::{MoeRoute, matvec_id, matvec_id_routed, route_lanes};
    use qk::ops::router::{self, RouterParams, SharedSlot};
    let Some(gpu) = test_gpu(false) else { return };
    // 40 experts + the shared one appended (41 in the stack), top-3 + shared, 3 tokens; logits in
    // rows of 41 with the shared gate logit last (the stacked router's layout).
    let (m, k, experts, top, tokens) = (32usize, 256usize, 40u32, 3u32, 3u32);
    if route_lanes(gpu, experts).is_none() {
        assert!(std::env::var("QK_REQUIRE_GPU").as_deref() != Ok("1") || !gpu.caps.subgroups);
        return;
    }
    let (w, _) = upload(gpu, GgmlType::IQ4XS, m, k, experts as usize + 1, 31);
    let stride = experts + 1;
    let logits = floats((tokens * stride) as usize, 32, 3.0);
    let x = floats(k * tokens as usize, 33, 1.0);
    let lb = gpu.buffer_from_f32("logits", &logits).unwrap();
    let xb = gpu.buffer_from_f32("x", &x).unwrap();
    let picks = top + 1;
    let n = (tokens * picks) as usize;
    let run = |routed: bool, shape: Option<MatvecShape>| {
        let ib = gpu.buffer_zeroed("ids", n as u64 * 4).unwrap();
        let wb = gpu.buffer_zeroed("weights", n as u64 * 4).unwrap();
        let yb = gpu.buffer_zeroed("y", (n * m * 4) as u64).unwrap();
        let ids = ExpertIds {
            buf: &ib,
            offset: 0,
            n_used: picks,
            n_tokens: tokens,
        };
        let (xc, yc) = (Columns::packed(&xb, k as u32), Columns::packed(&yb, m as u32));
        let mut rec = gpu.recorder();
        if routed {
            let route = MoeRoute {
                logits: &lb,
                offset: 0,
                stride,
                experts,
                shared: true,
                weights: &wb,
            };
            matvec_id_routed(gpu, &mut rec, &w, xc, yc, ids, &route, shape).unwrap();
        } else {
            let rp = RouterParams {
                tokens,
                experts,
                k: top,
                logits_offset: 0,
                logits_token_stride: stride,
            };
            let shared = SharedSlot {
                id: experts,
                gate: &lb,
                gate_offset: experts,
                gate_stride: stride,
            };
            router::record_with(gpu, &mut rec, &rp, &lb, &ib, &wb, Some(shared)).unwrap();
            matvec_id(gpu, &mut rec, &w, xc, yc, ids, MoeInput::PerToken).unwrap();
        }
        rec.submit().unwrap();
        (
            gpu.read_u32(&ib, 0, n).unwrap(),
            read(gpu, &wb, n),
            read(gpu, &yb, n * m),
        )
    };
    let (ids_a, w_a, y_a) = run(false, None);
    // The same routing code and the same product: the same bytes, with the IQ4_XS values from the
    // workgroup table or (where subgroups are wide enough) from subgroup shuffles.
    let shuffled = expert_shape(GgmlType::IQ4XS, false).with_lookup(Iq4Lookup::Shuffle);
    for shape in [None, Some(shuffled)] {
        let (ids_b, w_b, y_b) = run(true, shape);
        assert_eq!(ids_a, ids_b, "{shape:?}");
        assert_eq!(w_a, w_b, "{shape:?}");
        assert!(same_bits(&y_a, &y_b), "{shape:?}");
    }
}

#[test]
fn column_groups_give_every_column_the_same_bytes() {
    // A dispatch's columns split into groups (one group per workgroup) change who computes a column,
    // not how: every output, conv state and stored normalised input keeps the bytes of the one-group
    // dispatch. The decode step's fused stages: the norm with its input stored, the conv epilogue on
    // each column's slot and F32 rows riding in extra workgroups (the q‖k‖v‖z), the per-head RMS
    // with the residual added (the output projections), and a plain product of another word path.
    use qk::ops::matmul::matvec_shaped;
    let Some(gpu) = test_gpu(false) else { return };
    let (m, k, extra, channels, taps) = (48usize, 256usize, 10usize, 40usize, 4usize);
    let (heads, head_dim, parts) = (4u32, 64u32, 2u32);
    let stride = (taps - 1) * channels;
    let (iq4, _) = upload(gpu, GgmlType::IQ4XS, m, k, 1, 41);
    let (q8, _) = upload(gpu, GgmlType::Q8_0, m, k, 1, 42);
    let (ba, _) = upload(gpu, GgmlType::F32, extra, k, 1, 43);
    let cwb = gpu
        .buffer_from_f32("cw", &floats(channels * taps, 4, 1.0))
        .unwrap();
    let norm_w = gpu.buffer_from_f32("norm", &floats(k, 5, 1.0)).unwrap();
    let max_cols = 8usize;
    let slb = gpu.buffer_from_u32("slots", &[3, 0, 7, 1, 6, 2, 5, 4]).unwrap();
    let state0 = floats(max_cols * stride, 6, 1.0);
    let sums = gpu
        .buffer_from_f32("sums", &floats(max_cols * (heads * parts) as usize, 7, 30.0))
        .unwrap();
    let x = gpu.buffer_from_f32("x", &floats(k * max_cols, 30, 4.0)).unwrap();
    let res = gpu
        .buffer_from_f32("res", &floats(m * max_cols, 31, 2.0))
        .unwrap();
    let width = m + extra;
    // (y, conv states, stored input) of one product at `cols` columns in `groups` groups.
    let run = |case: usize, cols: usize, groups: u32, rows: u32| {
        let sb = gpu.buffer_from_f32("state", &state0).unwrap();
        let xn = gpu.buffer_zeroed("xn", (k * cols * 4) as u64).unwrap();
        let yb = gpu.buffer_zeroed("y", (width * cols * 4) as u64).unwrap();
        let (w, with_extra, fusion) = match case {
            0 => (
                &iq4,
                true,
                MatvecFusion {
                    input: MatvecInput::Rms {
                        weight: &norm_w,
                        eps: EPS,
                        store: None,
                    },
                    output: conv_output(&cwb, &sb, &slb, channels, taps),
                },
            ),
            1 => (
                &iq4,
                false,
                MatvecFusion {
                    input: MatvecInput::Rms {
                        weight: &norm_w,
                        eps: EPS,
                        store: Some(&xn),
                    },
                    output: MatvecOutput::Store,
                },
            ),
            2 => (
                &iq4,
                false,
                MatvecFusion {
                    input: MatvecInput::HeadRms {
                        sums: &sums,
                        heads,
                        head_dim,
                        parts,
                        offset: 0,
                        stride: heads * parts,
                        eps: EPS,
                    },
                    output: MatvecOutput::AddTo { residual: &res },
                },
            ),
            _ => (&q8, false, MatvecFusion::default()),
        };
        let width = if with_extra { width } else { m };
        let shape = MatvecShape::new(rows, 64, 1).with_col_groups(groups);
        let mut rec = gpu.recorder();
        let (xc, yc) = (Columns::packed(&x, k as u32), Columns::packed(&yb, width as u32));
        let extra = with_extra.then_some(&ba);
        matvec_shaped(gpu, &mut rec, w, extra, xc, yc, cols as u32, &fusion, Some(shape)).unwrap();
        rec.submit().unwrap();
        (
            read(gpu, &yb, width * cols),
            read(gpu, &sb, max_cols * stride),
            read(gpu, &xn, k * cols),
        )
    };
    for case in 0..4 {
        for (cols, groups) in [(8usize, 2u32), (8, 4), (8, 8), (6, 2), (6, 3), (5, 2)] {
            for rows in [4u32, 8] {
                let one = run(case, cols, 1, rows);
                let split = run(case, cols, groups, rows);
                let what = format!("case {case}, {cols} columns in {groups} groups, {rows} rows");
                assert!(same_bits(&one.0, &split.0), "{what}: outputs differ");
                assert!(same_bits(&one.1, &split.1), "{what}: conv states differ");
                assert!(same_bits(&one.2, &split.2), "{what}: stored inputs differ");
            }
        }
    }
}

/// What the decode stages of one case read and write.
struct DecodeBuffers<'a> {
    norm: &'a GpuBuffer,
    sums: &'a GpuBuffer,
    residual: &'a GpuBuffer,
    conv: &'a GpuBuffer,
    state: &'a GpuBuffer,
    slots: &'a GpuBuffer,
}

impl<'a> DecodeBuffers<'a> {
    /// The stages of `case`: "rms", "head_rms add", "add" or "rms conv".
    fn fusion(
        &self,
        case: &str,
        k: usize,
        heads: usize,
        parts: usize,
        channels: usize,
        taps: usize,
    ) -> MatvecFusion<'a> {
        let input = match case {
            "rms" | "rms conv" => MatvecInput::Rms {
                weight: self.norm,
                eps: EPS,
                store: None,
            },
            "head_rms add" => MatvecInput::HeadRms {
                sums: self.sums,
                heads: heads as u32,
                head_dim: (k / heads) as u32,
                parts: parts as u32,
                offset: 0,
                stride: (heads * parts) as u32,
                eps: EPS,
            },
            _ => MatvecInput::Plain,
        };
        let output = match case {
            "head_rms add" | "add" => MatvecOutput::AddTo {
                residual: self.residual,
            },
            "rms conv" => conv_output(self.conv, self.state, self.slots, channels, taps),
            _ => MatvecOutput::Store,
        };
        MatvecFusion { input, output }
    }
}

/// The decode products on tensor cores (`matvec_coop`) against the f32 mat-vec with the same
/// stages: the norm (its weights folded into the f16 inputs, its scale after), the head norm, the
/// residual add, and the conv epilogue with its slot states. Tolerance: f16 inputs give NMSE
/// ≈ 1.6e-7 against f32 products (matmul_tests' coop_nmse_max: 1e-6 with f32 accumulators, 1e-5
/// with f16). 300 rows: a partial third 128-row tile; 1 to 16 columns.
#[test]
fn tensor_core_decode_products_match_the_mat_vec() {
    use qk::ops::matmul::{CoopTile, coop_accumulator, matvec_coop, matvec_coop_fits};
    let Some(gpu) = test_gpu(false) else { return };
    let Some(acc) = coop_accumulator(gpu, CoopTile::NARROW_128X16) else {
        crate::matmul_tests::coop_not_exercised(gpu, "tensor-core decode products");
        return;
    };
    let tol = if acc == "f32" { 1e-6 } else { 1e-5 };
    let (m, k, channels, taps, n_slots) = (300usize, 512usize, 200usize, 4usize, 17usize);
    let (heads, parts) = (8usize, 3usize);
    let stride = (taps - 1) * channels;
    let g = gpu.buffer_from_f32("g", &floats(k, 9, 1.0)).unwrap();
    let cw = gpu
        .buffer_from_f32("cw", &floats(channels * taps, 4, 1.0))
        .unwrap();
    let slots: Vec<u32> = (0..16).map(|c| (c * 5 + 3) % n_slots as u32).collect();
    let slb = gpu.buffer_from_u32("slots", &slots).unwrap();
    let state0 = floats(n_slots * stride, 6, 1.0);
    for (i, ty) in [GgmlType::IQ4XS, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K]
        .into_iter()
        .enumerate()
    {
        let (w, _) = upload(gpu, ty, m, k, 1, 40 + i as u64);
        for cols in [1usize, 5, 8, 16] {
            let x = floats(k * cols, 50 + cols as u64, 30.0);
            let xb = gpu.buffer_from_f32("x", &x).unwrap();
            let res = gpu.buffer_from_f32("res", &floats(m * cols, 3, 2.0)).unwrap();
            let sums: Vec<f32> = floats(cols * heads * parts, 7, 1.0)
                .iter()
                .map(|v| 1.0 + v.abs() * 50.0)
                .collect();
            let sq = gpu.buffer_from_f32("sq", &sums).unwrap();
            for case in ["rms", "head_rms add", "add", "rms conv"] {
                let states = [
                    gpu.buffer_from_f32("state a", &state0).unwrap(),
                    gpu.buffer_from_f32("state b", &state0).unwrap(),
                ];
                let ys = [0, 1].map(|j| {
                    let yb = gpu.buffer_zeroed("y", (m * cols * 4) as u64).unwrap();
                    let b = DecodeBuffers {
                        norm: &g,
                        sums: &sq,
                        residual: &res,
                        conv: &cw,
                        state: &states[j],
                        slots: &slb,
                    };
                    let f = b.fusion(case, k, heads, parts, channels, taps);
                    assert!(matvec_coop_fits(gpu, &w, cols as u32, &f));
                    let mut rec = gpu.recorder();
                    let (xc, yc) = (Columns::packed(&xb, k as u32), Columns::packed(&yb, m as u32));
                    if j == 0 {
                        matvec_fused(gpu, &mut rec, &w, xc, yc, cols as u32, &f).unwrap();
                    } else {
                        matvec_coop(gpu, &mut rec, &w, xc, yc, cols as u32, &f).unwrap();
                    }
                    rec.submit().unwrap();
                    read(gpu, &yb, m * cols)
                });
                let want: Vec<f64> = ys[0].iter().map(|&v| f64::from(v)).collect();
                let e = nmse(&ys[1], &want);
                assert!(e < tol, "{ty} {cols} columns {case}: NMSE {e:e} ≥ {tol:e}");
                if case == "rms conv" {
                    let [a, b] = states.each_ref().map(|s| read(gpu, s, n_slots * stride));
                    let want: Vec<f64> = a.iter().map(|&v| f64::from(v)).collect();
                    let e = nmse(&b, &want);
                    assert!(e < tol, "{ty} {cols} columns: conv state NMSE {e:e}");
                    // Slots in no column keep their state, bit for bit.
                    for s in (0..n_slots as u32).filter(|s| !slots[..cols].contains(s)) {
                        let r = s as usize * stride..(s as usize + 1) * stride;
                        assert_eq!(b[r.clone()], state0[r], "{ty} {cols} columns: slot {s} touched");
                    }
                }
                println!("tensor-core decode {ty} {cols} columns {case} ({acc} accumulators): NMSE {e:e}");
            }
        }
    }
}
