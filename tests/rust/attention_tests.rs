//! The attention ops (ops/attention.rs) against their CPU references on every cache type, with and
//! without subgroups: prepare (norms, RoPE, cache store) for a prefill piece and for a step's rows,
//! decode over several slots at different positions (two buffer groups, a padding row, a cache of
//! thousands of positions) and prefill pieces; plus the split plan and the typed errors.

use qk::gpu::{Gpu, GpuBuffer};
use qk::ops::attention::{
    self, AttnRows, AttnShape, CoreArgs, GateLayout, KvGroup, KvType, OutLayout, PrefillKernel, PrepareArgs,
    ProjLayout, reference,
};
use qk::ops::rope::freq_table;

use crate::gpu_tests::{same_bits, test_gpu};
use crate::ops_tests::{Rng, nmse};

const TYPES: [(KvType, KvType); 3] = [
    (KvType::F32, KvType::F32),
    (KvType::F16, KvType::F16),
    (KvType::Q8_0, KvType::F16),
];

fn devices() -> Vec<&'static Gpu> {
    [false, true].into_iter().filter_map(test_gpu).collect()
}

/// A layer's cache for `slots` slots in buffers of `per_buffer` slots, the weights, and scratch
/// for up to `rows` rows, laid out as the engine does (q/gate interleaved per head, then K, V).
struct Case {
    shape: AttnShape,
    groups: Vec<(GpuBuffer, GpuBuffer, u32, u32)>,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    freqs: Vec<f32>,
    bufs: [GpuBuffer; 3],
    q_out: GpuBuffer,
    out: GpuBuffer,
    part: (GpuBuffer, GpuBuffer),
    rows_buf: GpuBuffer,
    rng: Rng,
    /// How decode walks the keys (`DecodeTuning::DEFAULT` unless a test sets another).
    walk: attention::DecodeTuning,
}

impl Case {
    fn new(gpu: &Gpu, shape: AttnShape, slots: u32, per_buffer: u32, rows: u32) -> Case {
        Case::with_decode_rows(gpu, shape, slots, per_buffer, rows, rows)
    }

    /// A case whose partials hold `decode_rows` decode rows' splits (and `rows` prefill rows'):
    /// prefill-only cases take 1, so the 80B model's heads fit a 128 MiB binding (lavapipe's).
    fn with_decode_rows(
        gpu: &Gpu,
        shape: AttnShape,
        slots: u32,
        per_buffer: u32,
        rows: u32,
        decode_rows: u32,
    ) -> Case {
        let mut rng = Rng::new(u64::from(shape.ctx) * 7 + u64::from(shape.head_dim));
        let mut groups = Vec::new();
        let mut first = 0;
        while first < slots {
            let n = per_buffer.min(slots - first);
            let cells = u64::from(n) * u64::from(shape.ctx);
            groups.push((
                gpu.buffer_zeroed("k", cells * shape.k_position_bytes()).unwrap(),
                gpu.buffer_zeroed("v", cells * shape.v_position_bytes()).unwrap(),
                first,
                n,
            ));
            first += n;
        }
        let hd = shape.head_dim as usize;
        let q_norm: Vec<f32> = (0..hd).map(|_| 1.0 + 0.5 * rng.uniform()).collect();
        let k_norm: Vec<f32> = (0..hd).map(|_| 1.5 + rng.uniform()).collect();
        let freqs = freq_table(shape.n_rot, 1e7);
        let bufs = [
            gpu.buffer_from_f32("q_norm", &q_norm).unwrap(),
            gpu.buffer_from_f32("k_norm", &k_norm).unwrap(),
            gpu.buffer_from_f32("freqs", &freqs).unwrap(),
        ];
        let qn = u64::from(rows) * u64::from(shape.heads) * u64::from(shape.head_dim);
        let (po, pml) = attention::partial_len(decode_rows, rows, shape.heads, shape.head_dim);
        Case {
            groups,
            q_norm,
            k_norm,
            freqs,
            bufs,
            q_out: gpu.buffer_zeroed("q_out", qn * 4).unwrap(),
            out: gpu.buffer_zeroed("out", qn * 4).unwrap(),
            part: (
                gpu.buffer_zeroed("part_o", po * 4).unwrap(),
                gpu.buffer_zeroed("part_ml", pml * 4).unwrap(),
            ),
            rows_buf: gpu.buffer_zeroed("rows", u64::from(rows) * 8).unwrap(),
            shape,
            rng,
            walk: attention::DecodeTuning::DEFAULT,
        }
    }

    fn layout(&self) -> ProjLayout {
        let (h, kv, hd) = (self.shape.heads, self.shape.kv_heads, self.shape.head_dim);
        ProjLayout {
            row_stride: 2 * h * hd + 2 * kv * hd,
            q_offset: 0,
            q_head_stride: 2 * hd,
            k_offset: 2 * h * hd,
            v_offset: 2 * h * hd + kv * hd,
        }
    }

    fn views(&self) -> Vec<KvGroup<'_>> {
        self.groups
            .iter()
            .map(|(k, v, first, n)| KvGroup {
                k,
                v,
                first_slot: *first,
                slots: *n,
            })
            .collect()
    }

    fn projection(&mut self, rows: u32) -> Vec<f32> {
        self.rng.vec((rows * self.layout().row_stride) as usize, 2.0)
    }

    fn prepare(&self, gpu: &Gpu, proj: &GpuBuffer, rows: AttnRows<'_>) {
        let args = PrepareArgs {
            proj,
            layout: self.layout(),
            q_norm: &self.bufs[0],
            k_norm: &self.bufs[1],
            freqs: &self.bufs[2],
            q_out: &self.q_out,
        };
        let mut rec = gpu.recorder();
        attention::record_prepare(gpu, &mut rec, &self.shape, rows, &self.views(), &args).unwrap();
        rec.submit().unwrap();
    }

    /// Write `rows` to the rows buffer and prepare a random projection for them.
    fn prepare_step(&mut self, gpu: &Gpu, rows: &[[u32; 2]]) -> (Vec<f32>, GpuBuffer) {
        gpu.write(&self.rows_buf, 0, bytemuck::cast_slice(rows)).unwrap();
        let n = rows.len() as u32;
        let proj = self.projection(n);
        let pb = gpu.buffer_from_f32("proj", &proj).unwrap();
        self.prepare(
            gpu,
            &pb,
            AttnRows::Step {
                buf: &self.rows_buf,
                n,
            },
        );
        (proj, pb)
    }

    /// Fill positions `0..len` of `slot` with random rows through the prepare op.
    fn fill(&mut self, gpu: &Gpu, slot: u32, len: u32) {
        let mut pos = 0;
        while pos < len {
            let n = (len - pos).min(64);
            let proj = gpu.buffer_from_f32("proj", &self.projection(n)).unwrap();
            self.prepare(gpu, &proj, AttnRows::Piece { slot, pos, n });
            pos += n;
        }
    }

    /// Decode the first `n` rows of the rows buffer; gate logits in `gate` (projection layout).
    fn decode(&self, gpu: &Gpu, n: u32, gate: &GpuBuffer) {
        let mut rec = gpu.recorder();
        let args = self.core_args(gate);
        attention::record_decode(
            gpu,
            &mut rec,
            &self.shape,
            &self.rows_buf,
            n,
            &self.views(),
            &args,
            self.walk,
        )
        .unwrap();
        rec.submit().unwrap();
    }

    fn core_args<'a>(&'a self, gate: &'a GpuBuffer) -> CoreArgs<'a> {
        let l = self.layout();
        CoreArgs {
            q: &self.q_out,
            gate: Some((
                gate,
                GateLayout {
                    offset: self.shape.head_dim,
                    row_stride: l.row_stride,
                    head_stride: 2 * self.shape.head_dim,
                },
            )),
            out: &self.out,
            out_layout: OutLayout {
                offset: 0,
                row_stride: self.shape.heads * self.shape.head_dim,
            },
            part_o: &self.part.0,
            part_ml: &self.part.1,
        }
    }

    /// Every cache buffer's words (K, V per group), read back once.
    fn read_cache(&self, gpu: &Gpu) -> Vec<(Vec<u32>, Vec<u32>)> {
        let all = |b: &GpuBuffer| gpu.read_u32(b, 0, (b.size / 4) as usize).unwrap();
        self.groups.iter().map(|(k, v, _, _)| (all(k), all(v))).collect()
    }

    /// The decoded K (or V) row of (slot, position, kv head) in a cache read back by `read_cache`.
    fn cell(&self, cache: &[(Vec<u32>, Vec<u32>)], v: bool, slot: u32, p: u32, g: u32) -> Vec<f32> {
        let s = &self.shape;
        let ty = if v { s.v_type } else { s.k_type };
        let words = ty.row_words(s.head_dim) as usize;
        let i = self
            .groups
            .iter()
            .position(|(_, _, f, n)| slot >= *f && slot < f + n)
            .unwrap();
        let cell = (((slot - self.groups[i].2) * s.ctx + p) * s.kv_heads + g) as usize;
        let raw = if v { &cache[i].1 } else { &cache[i].0 };
        reference::decode_row(ty, &raw[cell * words..(cell + 1) * words], s.head_dim as usize)
    }

    /// Attention of prepared row `r` (q read back from the GPU) at `pos` of `slot` in f64.
    fn want_row(&self, gpu: &Gpu, r: u32, slot: u32, pos: u32, proj: &[f32]) -> Vec<f32> {
        let cache = self.read_cache(gpu);
        let s = &self.shape;
        let hd = s.head_dim as usize;
        let qn = s.heads as usize * hd;
        let q = gpu
            .read_f32(&self.q_out, (r as usize * qn * 4) as u64, qn)
            .unwrap();
        let l = self.layout();
        let row = &proj[(r * l.row_stride) as usize..((r + 1) * l.row_stride) as usize];
        let gate: Vec<f32> = (0..s.heads as usize)
            .flat_map(|h| row[h * 2 * hd + hd..(h + 1) * 2 * hd].to_vec())
            .collect();
        let keys: Vec<Vec<Vec<f32>>> = (0..=pos)
            .map(|p| {
                (0..s.kv_heads)
                    .map(|g| self.cell(&cache, false, slot, p, g))
                    .collect()
            })
            .collect();
        let values: Vec<Vec<Vec<f32>>> = (0..=pos)
            .map(|p| {
                (0..s.kv_heads)
                    .map(|g| self.cell(&cache, true, slot, p, g))
                    .collect()
            })
            .collect();
        reference::attention_row(
            s,
            &q,
            Some(&gate),
            pos as usize + 1,
            &|p, g| keys[p][g].clone(),
            &|p, g| values[p][g].clone(),
        )
    }

    fn out_row(&self, gpu: &Gpu, r: u32) -> Vec<f32> {
        let qn = (self.shape.heads * self.shape.head_dim) as usize;
        gpu.read_f32(&self.out, (r as usize * qn * 4) as u64, qn).unwrap()
    }
}

fn shape(heads: u32, kv_heads: u32, head_dim: u32, ctx: u32, types: (KvType, KvType)) -> AttnShape {
    AttnShape {
        heads,
        kv_heads,
        head_dim,
        n_rot: 16,
        ctx,
        k_type: types.0,
        v_type: types.1,
        scale: 1.0 / (head_dim as f32).sqrt(),
        eps: 1e-6,
    }
}

/// Worst |got - want| over a row, relative to what the cache type may round: f32 ~1e-6 (f32 norm
/// and rotation against f64), f16 one half-ulp of the value (the shader may round either way),
/// q8_0 half a quantisation step d = amax/127 of the 32-block plus the f16 rounding of d.
fn check_stored(ty: KvType, got: &[f32], want: &[f32], what: &str) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = match ty {
            KvType::F32 => 2e-5,
            KvType::F16 => w.abs() * 2f32.powi(-10) + 2e-5,
            KvType::Q8_0 => {
                let block = &want[i / 32 * 32..(i / 32 + 1) * 32];
                let d = block.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
                0.51 * d + w.abs() * 2f32.powi(-10) + 2e-5
            }
        };
        assert!(
            (g - w).abs() <= tol,
            "{what} dim {i}: got {g}, want {w} (tolerance {tol})"
        );
    }
}

/// The reference values of row `r` of `proj` at `pos`: prepared q heads and the K, V of each kv head.
fn want_prepared(c: &Case, proj: &[f32], r: u32, pos: u32) -> (Vec<f32>, Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let s = &c.shape;
    let hd = s.head_dim as usize;
    let l = c.layout();
    let row = &proj[(r * l.row_stride) as usize..((r + 1) * l.row_stride) as usize];
    let q: Vec<f32> = (0..s.heads as usize)
        .flat_map(|h| {
            let x = &row[h * 2 * hd..h * 2 * hd + hd];
            reference::norm_rope(x, &c.q_norm, s.eps, s.n_rot, pos, &c.freqs)
                .into_iter()
                .map(|v| v as f32)
        })
        .collect();
    let k = (0..s.kv_heads as usize)
        .map(|g| {
            let x = &row[l.k_offset as usize + g * hd..l.k_offset as usize + (g + 1) * hd];
            reference::norm_rope(x, &c.k_norm, s.eps, s.n_rot, pos, &c.freqs)
                .into_iter()
                .map(|v| v as f32)
                .collect()
        })
        .collect();
    let v = (0..s.kv_heads as usize)
        .map(|g| row[l.v_offset as usize + g * hd..l.v_offset as usize + (g + 1) * hd].to_vec())
        .collect();
    (q, k, v)
}

fn check_prepared(gpu: &Gpu, c: &Case, proj: &[f32], r: u32, slot: u32, pos: u32) {
    let s = &c.shape;
    let qn = (s.heads * s.head_dim) as usize;
    let (q, k, v) = want_prepared(c, proj, r, pos);
    let got_q = gpu.read_f32(&c.q_out, (r as usize * qn * 4) as u64, qn).unwrap();
    check_stored(KvType::F32, &got_q, &q, &format!("q row {r}"));
    let cache = c.read_cache(gpu);
    for g in 0..s.kv_heads {
        let what = |x: &str| format!("{x} of slot {slot} pos {pos} head {g} ({:?})", s.k_type);
        check_stored(
            s.k_type,
            &c.cell(&cache, false, slot, pos, g),
            &k[g as usize],
            &what("K"),
        );
        check_stored(
            s.v_type,
            &c.cell(&cache, true, slot, pos, g),
            &v[g as usize],
            &what("V"),
        );
    }
}

/// Prepare for a prefill piece and for a step's rows (two buffer groups, a padding row) stores
/// what the reference computes, in every cache type, and writes nothing for the padding row.
#[test]
fn gpu_attention_prepare_matches_reference() {
    for gpu in devices() {
        for types in TYPES {
            let mut c = Case::new(gpu, shape(4, 2, 64, 300, types), 3, 2, 8);
            let proj = c.projection(5);
            let pb = gpu.buffer_from_f32("proj", &proj).unwrap();
            c.prepare(
                gpu,
                &pb,
                AttnRows::Piece {
                    slot: 2,
                    pos: 295,
                    n: 5,
                },
            );
            for r in 0..5 {
                check_prepared(gpu, &c, &proj, r, 2, 295 + r);
            }
            let rows: [[u32; 2]; 4] = [[1, 7], [u32::MAX, 9], [2, 0], [0, 299]];
            let (proj, _) = c.prepare_step(gpu, &rows);
            for (r, [slot, pos]) in rows.iter().enumerate() {
                if *slot != u32::MAX {
                    check_prepared(gpu, &c, &proj, r as u32, *slot, *pos);
                }
            }
            let cache = c.read_cache(gpu);
            for slot in 0..3 {
                assert!(
                    c.cell(&cache, false, slot, 9, 0).iter().all(|&x| x == 0.0),
                    "padding row wrote slot {slot}"
                );
            }
        }
    }
}

// f32 dot products and softmax sums over up to ~2900 keys against f64, on the GPU's own cache
// rows and q: measured ≤ 1e-13; any indexing or masking error gives ≥ 1e-3.
const CORE_NMSE: f64 = 1e-10;

/// Decode `rows` (after filling each row's slot up to its position) and check each against the
/// reference; returns the outputs.
fn decode_case(gpu: &Gpu, c: &mut Case, rows: &[[u32; 2]]) -> Vec<Vec<f32>> {
    for &[slot, pos] in rows {
        if slot != u32::MAX {
            c.fill(gpu, slot, pos);
        }
    }
    let (proj, pb) = c.prepare_step(gpu, rows);
    let qn = (c.shape.heads * c.shape.head_dim) as usize;
    let sentinel = vec![7.0f32; rows.len() * qn];
    gpu.write(&c.out, 0, bytemuck::cast_slice(&sentinel)).unwrap();
    c.decode(gpu, rows.len() as u32, &pb);
    let mut outs = Vec::new();
    for (r, &[slot, pos]) in rows.iter().enumerate() {
        let got = c.out_row(gpu, r as u32);
        outs.push(got.clone());
        if slot == u32::MAX {
            assert!(got.iter().all(|&x| x == 7.0), "padding row written");
            continue;
        }
        let e = nmse(&got, &c.want_row(gpu, r as u32, slot, pos, &proj));
        let s = &c.shape;
        assert!(
            e < CORE_NMSE,
            "{:?} hd {} slot {slot} pos {pos}: nmse {e}",
            (s.k_type, s.v_type),
            s.head_dim
        );
    }
    // The last row alone (as row 0 of a one-row step over the same prepared q): same bytes.
    let last = rows.len() - 1;
    let q = gpu.read_f32(&c.q_out, (last * qn * 4) as u64, qn).unwrap();
    gpu.write(&c.q_out, 0, bytemuck::cast_slice(&q)).unwrap();
    gpu.write(&c.rows_buf, 0, bytemuck::cast_slice(&rows[last]))
        .unwrap();
    let stride = c.layout().row_stride as usize;
    let gb = gpu
        .buffer_from_f32("gate", &proj[last * stride..(last + 1) * stride])
        .unwrap();
    c.decode(gpu, 1, &gb);
    assert_eq!(c.out_row(gpu, 0), outs[last], "row alone differs");
    outs
}

/// A decode step over rows of three slots at very different positions (one of ~2900 keys), across
/// two buffer groups, with a padding row, matches the reference row by row in every cache type;
/// each row's bytes equal those of the row stepped alone. Head dim 256 as well (32 lanes per key
/// on a GPU with 32-wide subgroups), and other walks of the keys (columns, keys per column,
/// shortest split, lanes per key), on the first device.
#[test]
fn gpu_attention_decode_matches_reference() {
    use attention::DecodeTuning;
    // The last two share each key among 8 and 4 lanes (each lane 4 and 8 of a 64-dim head's units
    // where subgroups are 32 wide; narrower subgroups cap them).
    let walks = [
        (2, 4, 16, 32),
        (1, 1, 64, 32),
        (8, 2, 32, 32),
        (16, 2, 32, 8),
        (4, 4, 16, 4),
    ]
    .map(|(cols, unroll, min_split, lanes)| DecodeTuning {
        cols,
        unroll,
        min_split,
        lanes,
    });
    for (i, gpu) in devices().into_iter().enumerate() {
        for types in TYPES {
            let mut c = Case::new(gpu, shape(4, 2, 64, 3000, types), 3, 2, 64);
            decode_case(gpu, &mut c, &[[0, 2900], [2, 0], [u32::MAX, 5], [1, 40]]);
            if i == 0 {
                let mut c = Case::new(gpu, shape(4, 2, 256, 200, types), 2, 2, 64);
                decode_case(gpu, &mut c, &[[1, 150], [0, 3]]);
            }
        }
        if i == 0 {
            for walk in walks {
                let mut c = Case::new(gpu, shape(4, 2, 64, 3000, TYPES[0]), 3, 2, 64);
                c.walk = walk;
                decode_case(gpu, &mut c, &[[0, 2900], [2, 0], [1, 40]]);
            }
        }
    }
}

/// Fill slot 1's first `prefix` positions, then prepare `n` rows from `prefix` on (K/V stored, q in
/// `q_out`); returns the projection and its buffer.
fn prepare_prompt(gpu: &Gpu, c: &mut Case, prefix: u32, n: u32) -> (Vec<f32>, GpuBuffer) {
    c.fill(gpu, 1, prefix);
    let proj = c.projection(n);
    let pb = gpu.buffer_from_f32("proj", &proj).unwrap();
    c.prepare(
        gpu,
        &pb,
        AttnRows::Piece {
            slot: 1,
            pos: prefix,
            n,
        },
    );
    (proj, pb)
}

/// Attention for the prepared rows as the consecutive pieces `pieces` with `kernel`, each piece run
/// as the engine runs it (its q and gate rows, and its outputs, from row 0); each row's output.
fn run_pieces(
    gpu: &Gpu,
    c: &Case,
    pb: &GpuBuffer,
    prefix: u32,
    pieces: &[u32],
    kernel: PrefillKernel,
) -> Vec<Vec<f32>> {
    let q_row = u64::from(c.shape.heads * c.shape.head_dim) * 4;
    let proj_row = u64::from(c.layout().row_stride) * 4;
    let mut outs = Vec::new();
    let mut done = 0;
    for &piece in pieces {
        let rows = u64::from(piece);
        let q = gpu.buffer_zeroed("q piece", rows * q_row).unwrap();
        let gate = gpu.buffer_zeroed("gate piece", rows * proj_row).unwrap();
        let mut rec = gpu.recorder();
        rec.copy(&c.q_out, u64::from(done) * q_row, &q, 0, rows * q_row)
            .unwrap();
        rec.copy(pb, u64::from(done) * proj_row, &gate, 0, rows * proj_row)
            .unwrap();
        let args = CoreArgs {
            q: &q,
            ..c.core_args(&gate)
        };
        attention::record_prefill(
            gpu,
            &mut rec,
            &c.shape,
            1,
            prefix + done,
            piece,
            &c.views(),
            &args,
            kernel,
        )
        .unwrap();
        rec.submit().unwrap();
        outs.extend((0..piece).map(|r| c.out_row(gpu, r)));
        done += piece;
    }
    outs
}

/// Prefill pieces (a first piece, one after a prefix of 300, and a GQA group of 3 whose tiles hold
/// 21 tokens) match the reference at every row in every cache type.
#[test]
fn gpu_attention_prefill_matches_reference() {
    for gpu in devices() {
        for types in TYPES {
            for (heads, kv_heads, hd, prefix, n) in
                [(4, 2, 64, 0, 19), (4, 2, 64, 300, 70), (6, 2, 32, 40, 45)]
            {
                let mut c = Case::new(gpu, shape(heads, kv_heads, hd, 512, types), 2, 2, 70);
                let (proj, pb) = prepare_prompt(gpu, &mut c, prefix, n);
                let outs = run_pieces(gpu, &c, &pb, prefix, &[n], PrefillKernel::Tiled);
                for (r, out) in (0..n).zip(&outs) {
                    let e = nmse(out, &c.want_row(gpu, r, 1, prefix + r, &proj));
                    assert!(
                        e < CORE_NMSE,
                        "{types:?} {heads}/{kv_heads}x{hd} row {r} of {prefix}+{n}: nmse {e}"
                    );
                }
            }
        }
    }
}

/// The cooperative-matrix prefill kernel (f16 q, K, V and weights, f32 accumulators) against the
/// f64 reference over the same f16 cache. Its error is the f16 rounding of q and of each weight
/// (2⁻¹¹ relative at most): a score s moves by up to |s|·2⁻¹¹, a weight by as much plus its own
/// rounding, and the output, an average of V rows under those weights, by about the same relative
/// amount. At the model's scale (1/√head_dim, |s| ≲ 10 here) that is NMSE ≈ 2.4e-7 per row:
/// bound 1e-6. The sharp case (scale 0.5: |s| up to ~100, a softmax dominated by a few keys, most
/// weights far below f16's normal range): the few weights that matter move by |s|·2⁻¹² ≈ 2% at
/// worst, in practice far less (measured 1.7e-6 on the H200): bound 1e-4, which a wrong max or a
/// lost key (an O(1) error) fails. Rows must also not depend on the piece that holds them (tiles
/// are aligned to the piece start, pieces to 64): one piece of 128 and two of 64 give the same
/// bytes. Shapes: the 80B model's (16 q heads over 2 kv heads of 256, a tile of 8 tokens) after a
/// prefix long enough for several splits, and the reference test's small ones (a group of 3: 21
/// tokens per tile).
#[test]
fn gpu_attention_prefill_coop_matches_reference() {
    let Some(gpu) = test_gpu(false) else { return };
    let types = (KvType::F16, KvType::F16);
    for (heads, kv_heads, hd, prefix, n, ctx, sharp) in [
        (16, 2, 256, 640, 128, 1024, false),
        (16, 2, 256, 640, 128, 1024, true),
        (4, 2, 64, 0, 19, 512, false),
        (4, 2, 64, 300, 70, 512, false),
        (6, 2, 32, 40, 45, 512, false),
    ] {
        let mut s = shape(heads, kv_heads, hd, ctx, types);
        let bound = if sharp {
            s.scale = 0.5;
            1e-4
        } else {
            1e-6
        };
        if !attention::coop_prefill_fits(gpu, &s) {
            // Asked for anyway, it is a typed error naming the adapter, not a pipeline failure.
            let c = Case::new(gpu, s, 2, 2, n);
            let mut rec = gpu.recorder();
            let gate = gpu
                .buffer_zeroed("gate", u64::from(n * c.layout().row_stride) * 4)
                .unwrap();
            let err = attention::record_prefill(
                gpu,
                &mut rec,
                &c.shape,
                1,
                0,
                n,
                &c.views(),
                &c.core_args(&gate),
                PrefillKernel::Coop,
            )
            .unwrap_err()
            .to_string();
            assert!(err.contains("cooperative prefill kernel cannot run"), "{err}");
            crate::matmul_tests::coop_not_exercised(
                gpu,
                &format!("cooperative prefill attention {heads}/{kv_heads}x{hd}"),
            );
            return;
        }
        let mut c = Case::with_decode_rows(gpu, s, 2, 2, n, 1);
        let (proj, pb) = prepare_prompt(gpu, &mut c, prefix, n);
        let outs = run_pieces(gpu, &c, &pb, prefix, &[n], PrefillKernel::Coop);
        let mut worst = 0f64;
        for (r, out) in (0..n).zip(&outs) {
            let e = nmse(out, &c.want_row(gpu, r, 1, prefix + r, &proj));
            worst = worst.max(e);
            assert!(
                e < bound,
                "{heads}/{kv_heads}x{hd} sharp {sharp} row {r} of {prefix}+{n}: nmse {e}"
            );
        }
        println!(
            "cooperative prefill attention {heads}/{kv_heads}x{hd} {prefix}+{n} sharp {sharp}: worst row nmse {worst:.2e}"
        );
        if n == 128 {
            let halves = run_pieces(gpu, &c, &pb, prefix, &[64, 64], PrefillKernel::Coop);
            for (r, (a, b)) in outs.iter().zip(&halves).enumerate() {
                assert!(same_bits(a, b), "row {r}: one piece and two pieces differ");
            }
        }
    }
}

#[test]
fn split_plan_covers_every_key_within_the_bounds() {
    for (min, max) in [
        (attention::DECODE_MIN_SPLIT, attention::DECODE_MAX_SPLITS),
        (attention::PREFILL_MIN_SPLIT, attention::PREFILL_MAX_SPLITS),
    ] {
        for n in (1..5000).chain([65_536, 262_144, 262_145]) {
            let (len, splits) = attention::split_plan(n, min, max);
            assert!(splits <= max && u64::from(len) * u64::from(splits) >= u64::from(n));
            assert!(
                len == min || (len / 2) * max < n,
                "n {n}: split {len} longer than needed"
            );
        }
    }
    assert_eq!(attention::split_plan(8192, 32, 64), (128, 64));
}

#[test]
fn bad_cache_types_and_shapes_are_typed_errors() {
    use qk::QkError;
    assert!(matches!(KvType::parse("q4_0"), Err(QkError::Engine(_))));
    assert_eq!(KvType::parse("Q8_0").unwrap(), KvType::Q8_0);
    let ok = shape(16, 2, 256, 262_144, (KvType::Q8_0, KvType::F16));
    ok.validate().unwrap();
    // The reported bytes per slot at 262,144 positions: K q8_0 (8.5 bits), V f16.
    assert_eq!(ok.slot_bytes(), 262_144 * 2 * (272 + 512));
    for bad in [
        shape(16, 2, 256, 64, (KvType::F16, KvType::Q8_0)),
        shape(16, 2, 48, 64, (KvType::Q8_0, KvType::F16)),
        shape(16, 3, 64, 64, (KvType::F16, KvType::F16)),
        shape(64, 2, 64, 64, (KvType::F16, KvType::F16)),
    ] {
        assert!(matches!(bad.validate(), Err(QkError::Engine(_))), "{bad:?}");
    }
    // A slot whose cache cannot fit one binding is an out-of-memory error, not a panic.
    let huge = shape(16, 2, 256, 262_144, (KvType::F32, KvType::F32));
    assert!(matches!(
        huge.slots_per_buffer(1 << 28, 1 << 40),
        Err(QkError::OutOfMemory(_))
    ));
    assert_eq!(huge.slots_per_buffer(1 << 32, 1 << 40).unwrap(), 8);
}
