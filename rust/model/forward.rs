//! The per-layer forward graph (docs/numerics.md "Forward pass") recorded into one command sequence: scratch
//! activations sized for a batch of rows, per-slot recurrent state (KV, conv, DeltaNet S), and the
//! recording of a prefill piece of one slot (rows = consecutive positions) or a decode step of
//! several slots (rows = one position each).

use std::sync::Arc;

use super::config::{Arch, LayerKind, ModelConfig};
use super::kv::KvLayer;
use super::weights::{
    AttnProjection, BetaAlpha, DeltaNetProjection, ExpertGateUp, LayerWeights, Mixer, Stacked, Weights,
};
use crate::error::{QkError, Result};
use crate::gpu::{Gpu, GpuBuffer, Recorder, WeightTensor};
use crate::ops::attention::{
    self, AttnRows, AttnShape, CoreArgs, GateLayout, OutLayout, PrepareArgs, ProjLayout,
};
use crate::ops::conv::{self, ConvParams};
use crate::ops::deltanet::{self, DeltaArgs, DeltaParams, HeadPairing};
use crate::ops::elementwise::{self, EwArgs, EwKind, EwParams};
use crate::ops::embed::{Ids, embed};
use crate::ops::matmul::{
    self, ColumnClass, Columns, ExpertGroups, ExpertIds, GroupShape, MOE_TILE_COLS, MatvecShape, MoeInput,
    Precision, column_class, group_experts, moe_tile_cols, mul_id,
};
use crate::ops::norm::{self, NormArgs, NormKind, NormParams, RowLayout};
use crate::ops::router::{self, RouterParams};
use crate::ops::topk::{self, MAX_K, TopkParams};

/// Recurrent state of one local layer for one slot.
pub enum LayerState {
    /// The layer's KV cache (shared by every slot) and this slot's index in it.
    Attention { kv: Arc<KvLayer>, slot: u32 },
    /// Conv rows (K−1 pre-conv inputs) and the DeltaNet matrices S of every v-head: this slot's
    /// ranges (byte offsets) of the layer's two buffers, which hold every slot back to back (slot i
    /// at i · conv_bytes / i · ssm_bytes), so one dispatch can step all slots of a decode step.
    DeltaNet {
        conv: GpuBuffer,
        conv_offset: u64,
        s: GpuBuffer,
        s_offset: u64,
    },
}

impl LayerState {
    /// (buffer, byte offset, bytes) of each part of this slot's state: its KV cells of positions
    /// `0..pos` (their bytes depend on the cache types), or its conv rows and S.
    pub fn parts(&self, cfg: &ModelConfig, pos: u32) -> Result<[(&GpuBuffer, u64, u64); 2]> {
        match self {
            LayerState::Attention { kv, slot } => kv.slot_ranges(*slot, pos),
            LayerState::DeltaNet {
                conv,
                conv_offset,
                s,
                s_offset,
            } => Ok([
                (conv, *conv_offset, conv_bytes(cfg)),
                (s, *s_offset, ssm_bytes(cfg)),
            ]),
        }
    }
}

/// One slot: its position (tokens already run) and its state per local layer.
pub struct SlotState {
    pub pos: u32,
    pub layers: Vec<LayerState>,
}

impl SlotState {
    /// The state of `n_slots` slots: each attention layer's KV cache shared by all of them
    /// (`shape`), each DeltaNet layer's conv rows and S in one buffer per layer with a slot axis.
    /// `spare`: that axis has one entry more, index `n_slots`, which no slot owns: a retired armed
    /// step (engine.rs) runs its recurrent updates there.
    pub fn new_all(
        gpu: &Gpu,
        cfg: &ModelConfig,
        layers: &[LayerWeights],
        shape: AttnShape,
        n_slots: u32,
        spare: bool,
    ) -> Result<Vec<SlotState>> {
        let mut slots: Vec<SlotState> = (0..n_slots)
            .map(|_| SlotState {
                pos: 0,
                layers: Vec::new(),
            })
            .collect();
        let (cb, sb) = (conv_bytes(cfg), ssm_bytes(cfg));
        for lw in layers {
            let il = lw.index;
            match cfg.kinds[il as usize] {
                LayerKind::Attention => {
                    let kv = Arc::new(KvLayer::new(gpu, shape, n_slots, il)?);
                    for (i, slot) in slots.iter_mut().enumerate() {
                        slot.layers.push(LayerState::Attention {
                            kv: kv.clone(),
                            slot: i as u32,
                        });
                    }
                }
                LayerKind::DeltaNet => {
                    let all = u64::from(n_slots) + u64::from(spare);
                    crate::ensure!(
                        all * sb <= gpu.caps.max_binding_size,
                        QkError::OutOfMemory(format!(
                            "DeltaNet state of layer {il}: {n_slots} slots need {} bytes, more than one binding ({})",
                            all * sb,
                            gpu.caps.max_binding_size
                        ))
                    );
                    let conv = gpu.buffer_zeroed(&format!("conv{il}"), all * cb)?;
                    let s = gpu.buffer_zeroed(&format!("ssm{il}"), all * sb)?;
                    for (i, slot) in slots.iter_mut().enumerate() {
                        slot.layers.push(LayerState::DeltaNet {
                            conv: conv.clone(),
                            conv_offset: i as u64 * cb,
                            s: s.clone(),
                            s_offset: i as u64 * sb,
                        });
                    }
                }
            }
        }
        Ok(slots)
    }

    /// Zero the recurrent state (KV rows beyond the position are never read).
    pub fn reset(&mut self, gpu: &Gpu, cfg: &ModelConfig) -> Result<()> {
        for l in &self.layers {
            if let LayerState::DeltaNet {
                conv,
                conv_offset,
                s,
                s_offset,
            } = l
            {
                gpu.write(conv, *conv_offset, &vec![0u8; conv_bytes(cfg) as usize])?;
                gpu.write(s, *s_offset, &vec![0u8; ssm_bytes(cfg) as usize])?;
            }
        }
        self.pos = 0;
        Ok(())
    }
}

pub fn conv_bytes(cfg: &ModelConfig) -> u64 {
    u64::from(cfg.conv_taps - 1) * u64::from(cfg.conv_dim()) * 4
}

pub fn ssm_bytes(cfg: &ModelConfig) -> u64 {
    u64::from(cfg.v_heads) * u64::from(cfg.dk) * u64::from(cfg.dv) * 4
}

/// Activations for up to `rows` rows, reused by every call (so a steady decode step allocates
/// nothing and every bind group is cached).
pub struct Scratch {
    pub rows: u32,
    pub x: [GpuBuffer; 2],
    pub(crate) xn: GpuBuffer,
    pub(crate) mix: GpuBuffer,
    /// DeltaNet: [q‖k‖v pre-conv | beta/alpha logits] per row.
    pub(crate) gproj: GpuBuffer,
    /// Legacy `ssm_in` output before it is regrouped into gproj and z.
    pub(crate) legacy: GpuBuffer,
    pub(crate) conv_out: GpuBuffer,
    /// Decode: [conv(q ‖ k ‖ v) | z | beta/alpha] per row (rust/model/decode.rs).
    pub(crate) dn_proj: GpuBuffer,
    pub(crate) z: GpuBuffer,
    pub(crate) dn_out: GpuBuffer,
    pub(crate) gated: GpuBuffer,
    /// Decode: each row's sums of o² per (v-head, part) from the GDN step (ops/gdn_step.rs).
    pub(crate) gated_sums: GpuBuffer,
    pub(crate) dn_scratch: GpuBuffer,
    /// Attention: [q+gate | K | V] per row, prepared q, gated output, split partials (ops/attention.rs).
    pub(crate) aproj: GpuBuffer,
    pub(crate) q: GpuBuffer,
    pub(crate) attn_out: GpuBuffer,
    pub(crate) part_out: GpuBuffer,
    pub(crate) part_ml: GpuBuffer,
    /// A decode step's `[slot, pos]` per row (ops/attention.rs), written once per step.
    pub attn_rows: GpuBuffer,
    pub(crate) router_logits: GpuBuffer,
    pub(crate) expert_ids: GpuBuffer,
    pub(crate) expert_w: GpuBuffer,
    /// The rows' (token, slot) entries grouped by expert for the grouped mat-mat (u32).
    pub(crate) expert_groups: GpuBuffer,
    pub(crate) gate_up: GpuBuffer,
    pub(crate) act: GpuBuffer,
    pub(crate) down: GpuBuffer,
    pub(crate) sh_gate_up: GpuBuffer,
    pub(crate) sh_act: GpuBuffer,
    pub(crate) sh_down: GpuBuffer,
    pub(crate) sh_gate: GpuBuffer,
    /// Split-K partial sums of the dense mat-mats (ops/matmul.rs `k_splits`).
    pub(crate) split: GpuBuffer,
    /// Rows of logits the head computes at once (`logits`, `results` hold that many).
    pub head_rows: u32,
    pub logits: GpuBuffer,
    pub tokens: GpuBuffer,
    pub(crate) topk_candidates: GpuBuffer,
    /// Top-k results of a batch of rows: rows × k pairs (k ≤ MAX_K), row-major.
    pub results: GpuBuffer,
    /// The final row of a prefill piece (its own k).
    pub result_last: GpuBuffer,
    /// Decode: the slot of each row (u32), written by the engine before each step.
    pub(crate) slots: GpuBuffer,
    /// Greedy (id, logit) of every row of a prefill piece, gathered from the head's row groups.
    pub piece_ids: GpuBuffer,
    pub bytes: u64,
}

impl Scratch {
    /// Activations for `rows` rows (prefill pieces) and decode steps of up to `step_rows`; with
    /// `has_head`, logits for `head_rows` of them at a time.
    pub fn new(
        gpu: &Gpu,
        cfg: &ModelConfig,
        rows: u32,
        head_rows: u32,
        step_rows: u32,
        has_head: bool,
        legacy: bool,
    ) -> Result<Scratch> {
        let mut bytes = 0u64;
        let mut buf = |name: &str, floats: u64| -> Result<GpuBuffer> {
            // Every scratch buffer is bound whole, so none may outgrow a binding (lavapipe: 128 MiB).
            let size = floats.max(1) * 4;
            if size > gpu.caps.max_binding_size {
                return Err(QkError::OutOfMemory(format!(
                    "scratch {name} for {rows}-row prefill pieces needs {size} bytes, more than the \
                     device's largest binding ({} bytes): use smaller prefill_rows",
                    gpu.caps.max_binding_size
                )));
            }
            let b = gpu.buffer_zeroed(name, size)?;
            bytes += b.size;
            Ok(b)
        };
        let r = u64::from(rows);
        let e = u64::from(cfg.n_embd);
        let k = u64::from(cfg.experts_used);
        let (ff, sff) = (u64::from(cfg.expert_ff), u64::from(cfg.shared_ff));
        let gw = u64::from(cfg.conv_dim() + 2 * cfg.v_heads);
        let aw = u64::from(attn_proj_width(cfg));
        let hd = u64::from(cfg.heads * cfg.head_dim);
        let dparams = delta_params(cfg);
        let (po, pml) = attention::partial_len(step_rows.min(rows), rows, cfg.heads, cfg.head_dim);
        let vocab = u64::from(cfg.vocab);
        let head_rows = head_rows.min(rows);
        let logit_rows = if has_head { u64::from(head_rows) } else { 0 };
        let topk_probe = TopkParams::new(cfg.vocab.max(MAX_K), MAX_K, 0)?;
        Ok(Scratch {
            rows,
            x: [buf("x0", r * e)?, buf("x1", r * e)?],
            xn: buf("xn", r * e)?,
            mix: buf("mix", r * e)?,
            gproj: buf("gdn.proj", r * gw)?,
            legacy: buf(
                "gdn.legacy_qkvz",
                if legacy {
                    r * u64::from(cfg.conv_dim() + cfg.value_dim())
                } else {
                    0
                },
            )?,
            conv_out: buf("gdn.conv_out", r * u64::from(cfg.conv_dim()))?,
            dn_proj: buf(
                "gdn.decode_proj",
                r * u64::from(cfg.conv_dim() + cfg.value_dim() + 2 * cfg.v_heads),
            )?,
            z: buf("gdn.z", r * u64::from(cfg.value_dim()))?,
            dn_out: buf("gdn.out", r * u64::from(cfg.value_dim()))?,
            gated: buf("gdn.gated", r * u64::from(cfg.value_dim()))?,
            // At most one part per value column.
            gated_sums: buf("gdn.gated_sums", r * u64::from(cfg.value_dim()))?,
            dn_scratch: buf("gdn.scratch", dparams.scratch_len(rows.max(deltanet::CHUNK)))?,
            aproj: buf("attn.proj", r * aw)?,
            q: buf("attn.q", r * hd)?,
            attn_out: buf("attn.out", r * hd)?,
            part_out: buf("attn.partial_out", po)?,
            part_ml: buf("attn.partial_ml", pml)?,
            attn_rows: buf("attn.rows", 2 * r)?,
            // Expert logits, then (stacked router) the shared expert's gate logit, per row.
            router_logits: buf("moe.router", r * u64::from(cfg.experts + 1))?,
            // k routed picks, and the shared expert as pick k in the decode step.
            expert_ids: buf("moe.ids", r * (k + 1))?,
            expert_w: buf("moe.weights", r * (k + 1))?,
            expert_groups: buf(
                "moe.groups",
                GroupShape {
                    experts: cfg.experts,
                    n_used: cfg.experts_used,
                    n_tokens: rows,
                    tile_cols: MOE_TILE_COLS,
                }
                .words(),
            )?,
            // The expert columns, then (ff == shared_ff) the shared expert's t columns.
            gate_up: buf("moe.gate_up", r * (k + 1) * 2 * ff)?,
            act: buf("moe.act", r * (k + 1) * ff)?,
            down: buf("moe.down", r * (k + 1) * e)?,
            sh_gate_up: buf("shexp.gate_up", r * 2 * sff)?,
            sh_act: buf("shexp.act", r * sff)?,
            sh_down: buf("shexp.down", r * e)?,
            sh_gate: buf("shexp.gate", r)?,
            split: buf("matmul.split", r * split_floats_per_col(cfg))?,
            head_rows,
            logits: buf("logits", logit_rows * vocab)?,
            tokens: buf("tokens", r)?,
            topk_candidates: buf(
                "topk.candidates",
                logit_rows * 2 * u64::from(topk_probe.candidates()),
            )?,
            results: buf("topk.results", logit_rows * 2 * u64::from(MAX_K))?,
            result_last: buf("topk.result_last", 2 * u64::from(MAX_K))?,
            slots: buf("decode.slots", r)?,
            piece_ids: buf("topk.piece_ids", if has_head { r * 2 } else { 0 })?,
            bytes,
        })
    }
}

/// Floats per activation column the largest split-K product of this model writes
/// (`matmul::k_splits`), over every dense matrix shape a layer or the head can have; from the
/// configuration alone, so every stage of a split sizes it alike.
fn split_floats_per_col(cfg: &ModelConfig) -> u64 {
    let e = cfg.n_embd;
    let (cd, vd, nv) = (cfg.conv_dim(), cfg.value_dim(), cfg.v_heads);
    let (qw, kvw) = (2 * cfg.heads * cfg.head_dim, cfg.kv_row());
    let sff = cfg.shared_ff;
    let shapes = [
        (cd, e),
        (vd, e),
        (cd + vd, e),
        (2 * nv, e),
        (nv, e),
        (e, vd),
        (attn_proj_width(cfg), e),
        (qw, e),
        (kvw, e),
        (e, cfg.heads * cfg.head_dim),
        (cfg.experts + 1, e),
        (cfg.experts, e),
        (1, e),
        (2 * sff, e),
        (sff, e),
        (e, sff),
        (cfg.vocab, e),
    ];
    shapes
        .iter()
        .map(|&(rows, k)| {
            let s = matmul::k_splits(u64::from(rows), u64::from(k));
            if s > 1 { u64::from(s) * u64::from(rows) } else { 0 }
        })
        .max()
        .unwrap_or(0)
}

pub(crate) fn attn_proj_width(cfg: &ModelConfig) -> u32 {
    2 * cfg.heads * cfg.head_dim + 2 * cfg.kv_row()
}

/// Layers of a prefill piece recorded per submit (see [`Model::record_layers`]).
const PREFILL_LAYERS_PER_SUBMIT: usize = 4;

/// A decode step's `[slot, pos]` rows into `s.attn_rows` (once per step, before the layers); a
/// stage without attention layers has nothing to write.
pub fn write_step_rows(gpu: &Gpu, s: &Scratch, states: &[&SlotState], positions: &[u32]) -> Result<()> {
    let mut rows = Vec::with_capacity(2 * positions.len());
    for (st, &pos) in states.iter().zip(positions) {
        let Some(slot) = st.layers.iter().find_map(|l| match l {
            LayerState::Attention { slot, .. } => Some(*slot),
            LayerState::DeltaNet { .. } => None,
        }) else {
            return Ok(());
        };
        rows.extend([slot, pos]);
    }
    crate::ensure!(
        rows.len() as u32 <= 2 * s.rows,
        QkError::Engine(format!(
            "step of {} rows exceeds the scratch of {}",
            positions.len(),
            s.rows
        ))
    );
    gpu.write(&s.attn_rows, 0, bytemuck::cast_slice(&rows))
}

pub(crate) fn delta_params(cfg: &ModelConfig) -> DeltaParams {
    let key_dim = cfg.k_heads * cfg.dk;
    let nv = cfg.v_heads;
    let r = nv / cfg.k_heads;
    let (pairing, ba_group, ba_group_stride, alpha_offset) = match cfg.arch {
        // ssm_ba: per k-group g rows [g·2r, g·2r+r) = beta, next r = alpha (docs/numerics.md "Tensors").
        Arch::Qwen3Next => (HeadPairing::Grouped, r, 2 * r, r),
        Arch::Qwen35Moe => (HeadPairing::Tiled, nv, 0, nv),
    };
    DeltaParams {
        tokens: 0,
        k_heads: cfg.k_heads,
        v_heads: nv,
        dk: cfg.dk,
        dv: cfg.dv,
        pairing: pairing as u32,
        first_token: 0,
        chunks: 0,
        qkv_token_stride: cfg.conv_dim(),
        q_offset: 0,
        k_offset: key_dim,
        v_offset: 2 * key_dim,
        ba_token_stride: cfg.conv_dim() + 2 * nv,
        ba_group,
        ba_group_stride,
        beta_offset: cfg.conv_dim(),
        alpha_offset: cfg.conv_dim() + alpha_offset,
        out_offset: 0,
        out_token_stride: cfg.value_dim(),
        state_offset: 0,
        eps: cfg.eps,
        q_scale: 1.0 / (cfg.dk as f32).sqrt(),
        _pad0: 0,
        _pad1: 0,
    }
}

/// What one recorded batch covers.
#[derive(Clone, Copy, Debug)]
pub enum Batch<'a> {
    /// `n` consecutive positions of one slot starting at `base` (rows 0..n).
    Prefill { base: u32, n: u32 },
    /// One position per slot: row i is slot `slots[i]` at `positions[i]`.
    Decode { positions: &'a [u32] },
}

impl Batch<'_> {
    pub fn rows(&self) -> u32 {
        match self {
            Batch::Prefill { n, .. } => *n,
            Batch::Decode { positions } => positions.len() as u32,
        }
    }
}

/// Everything the forward pass reads that is not per call.
pub struct Model {
    pub cfg: ModelConfig,
    pub weights: Weights,
    pub freqs: GpuBuffer,
    pub ctx: u32,
    /// How prefill products are computed (the engine's `precise` option).
    pub precision: Precision,
    /// Decode steps of up to this many rows route inside the experts' gate/up product
    /// (`EngineOptions::route_inside_max_rows`; 1 by default).
    pub route_inside_max_rows: u32,
    /// How decode attention walks the keys (`EngineOptions::attention_walk`).
    pub attention_walk: attention::DecodeTuning,
    /// Columns per workgroup of the decode step's dense mat-vecs at most
    /// (`EngineOptions::dense_group_cols`).
    pub dense_group_cols: u32,
    /// Launch shapes of the decode step's mat-vecs by op (`EngineOptions::decode_shapes`).
    pub decode_shapes: Vec<(String, MatvecShape)>,
    /// Decode steps of at least this many rows take the tensor-core dense products
    /// (`EngineOptions::tensor_core_decode_cols`; None for precise engines).
    pub tensor_core_decode_cols: Option<u32>,
}

/// Bytes of a dense weight matrix (what one mat-vec reads).
pub(crate) fn dense_bytes(w: &WeightTensor) -> u64 {
    w.rows * w.row_bytes * w.experts
}

/// Bytes of the experts a MoE mat-vec over `t` tokens reads: n_used per token, counted as
/// distinct (an upper bound when tokens share experts).
pub(crate) fn expert_bytes(w: &WeightTensor, n_used: u32, t: u32) -> u64 {
    w.rows * w.row_bytes * (u64::from(n_used) * u64::from(t)).min(w.experts)
}

pub(crate) fn cols(buf: &GpuBuffer, offset: u32, stride: u32) -> Columns<'_> {
    Columns { buf, offset, stride }
}

fn ew(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    kind: EwKind,
    p: &EwParams,
    a: &GpuBuffer,
    b: Option<&GpuBuffer>,
    out: &GpuBuffer,
) -> Result<()> {
    elementwise::record(
        gpu,
        rec,
        kind,
        p,
        &EwArgs {
            a,
            b,
            out,
            weights: None,
            gate: None,
        },
    )
}

impl Model {
    /// A product over `ncols` activation columns with this model's precision (split over K into
    /// the scratch's partials where the matrix calls for it).
    #[allow(clippy::too_many_arguments)]
    fn mul(
        &self,
        gpu: &Gpu,
        rec: &mut Recorder<'_>,
        s: &Scratch,
        w: &WeightTensor,
        x: Columns<'_>,
        y: Columns<'_>,
        ncols: u32,
    ) -> Result<()> {
        matmul::mul(gpu, rec, w, x, y, ncols, self.precision, Some(&s.split))
    }

    /// Token embeddings of `n` ids (written to `s.tokens`, or a previous step's top-k rows) into x[0].
    pub fn record_embed(
        &self,
        gpu: &Gpu,
        rec: &mut Recorder<'_>,
        s: &Scratch,
        ids: Ids<'_>,
        n: u32,
    ) -> Result<()> {
        let table = self.weights.embed.as_ref().ok_or_else(|| {
            QkError::Engine("this stage has no embedding (layers do not start at 0): pass hidden rows".into())
        })?;
        rec.op("embed", None, u64::from(n) * table.row_bytes);
        embed(gpu, rec, table, ids, n, Columns::packed(&s.x[0], self.cfg.n_embd))
    }

    /// Every local layer over the rows in x[0]; returns the index of the x buffer holding the output.
    pub fn record_layers(
        &self,
        gpu: &Gpu,
        rec: &mut Recorder<'_>,
        s: &Scratch,
        states: &[&SlotState],
        batch: Batch<'_>,
    ) -> Result<usize> {
        if let Batch::Decode { positions } = batch {
            write_step_rows(gpu, s, states, positions)?;
        }
        let mut cur = 0usize;
        let flush = matches!(batch, Batch::Prefill { .. });
        for (li, lw) in self.weights.layers.iter().enumerate() {
            let layer_states: Vec<&LayerState> = states.iter().map(|st| &st.layers[li]).collect();
            self.record_layer(gpu, rec, s, lw, &layer_states, batch, cur)?;
            cur = 1 - cur;
            // A prefill piece is ~27 dispatches per layer at several µs of host time each: handed
            // to the GPU after its first layer and then every few layers, the rest is recorded
            // while the GPU runs (one submit after the whole piece left the GPU idle for the
            // piece's recording). The commands and their order are the same: so are the bytes.
            let boundary = li == 0 || (li + 1) % PREFILL_LAYERS_PER_SUBMIT == 0;
            if flush && boundary && li + 1 < self.weights.layers.len() {
                rec.flush()?;
            }
        }
        Ok(cur)
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn record_layer(
        &self,
        gpu: &Gpu,
        rec: &mut Recorder<'_>,
        s: &Scratch,
        lw: &LayerWeights,
        states: &[&LayerState],
        batch: Batch<'_>,
        cur: usize,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let t = batch.rows();
        let e = cfg.n_embd;
        let rows_e = RowLayout::packed(e, 1);
        let x = &s.x[cur];
        let x_next = &s.x[1 - cur];
        let layer = Some(lw.index);
        rec.op("attn_norm", layer, 0);
        norm::record(
            gpu,
            rec,
            NormKind::Rms,
            &NormParams::new(t, 1, e, rows_e, rows_e, cfg.eps, 1.0),
            &NormArgs {
                src: x,
                dst: &s.xn,
                weight: Some(&lw.attn_norm),
                other: None,
                sum: None,
            },
        )?;
        match &lw.mixer {
            Mixer::DeltaNet(w) => self.record_deltanet(gpu, rec, s, w, states, batch, layer)?,
            Mixer::Attention(w) => self.record_attention(gpu, rec, s, w, states, batch, layer)?,
        }
        // h = x + mixer; xn = RMSNorm(h) (docs/numerics.md "Block structure").
        rec.op("post_norm", layer, 0);
        norm::record(
            gpu,
            rec,
            NormKind::RmsResidual,
            &NormParams::new(t, 1, e, rows_e, rows_e, cfg.eps, 1.0),
            &NormArgs {
                src: &s.mix,
                dst: &s.xn,
                weight: Some(&lw.post_norm),
                other: Some(x),
                sum: Some(x_next),
            },
        )?;
        self.record_moe(gpu, rec, s, lw, t, x_next, layer)
    }

    #[allow(clippy::too_many_arguments)]
    fn record_deltanet(
        &self,
        gpu: &Gpu,
        rec: &mut Recorder<'_>,
        s: &Scratch,
        w: &super::weights::DeltaNetWeights,
        states: &[&LayerState],
        batch: Batch<'_>,
        layer: Option<u32>,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let t = batch.rows();
        let e = cfg.n_embd;
        let (cd, vd, nv) = (cfg.conv_dim(), cfg.value_dim(), cfg.v_heads);
        let gw = cd + 2 * nv;
        let xn = Columns::packed(&s.xn, e);
        match &w.proj {
            DeltaNetProjection::Split { qkv, gate, .. } => {
                rec.op("dn.qkv", layer, dense_bytes(qkv));
                self.mul(gpu, rec, s, qkv, xn, cols(&s.gproj, 0, gw), t)?;
                rec.op("dn.gate", layer, dense_bytes(gate));
                self.mul(gpu, rec, s, gate, xn, Columns::packed(&s.z, vd), t)?;
            }
            DeltaNetProjection::Legacy(qkvz) => {
                // One projection, then per k-head group four row copies into the q ‖ k ‖ v and z
                // layouts the conv and gated norm read (4·nk small dispatches: legacy files only).
                let lw = cd + vd;
                rec.op("dn.qkvz", layer, dense_bytes(qkvz));
                self.mul(gpu, rec, s, qkvz, xn, Columns::packed(&s.legacy, lw), t)?;
                rec.op("dn.qkvz_regroup", layer, 0);
                let (dk, key_dim) = (cfg.dk, cfg.k_heads * cfg.dk);
                let rv = (nv / cfg.k_heads) * cfg.dv;
                let group = 2 * dk + 2 * rv;
                for g in 0..cfg.k_heads {
                    let src = g * group;
                    let pieces = [
                        (src, dk, &s.gproj, g * dk, gw),
                        (src + dk, dk, &s.gproj, key_dim + g * dk, gw),
                        (src + 2 * dk, rv, &s.gproj, 2 * key_dim + g * rv, gw),
                        (src + 2 * dk + rv, rv, &s.z, g * rv, vd),
                    ];
                    for (a_offset, n, dst, out_offset, out_stride) in pieces {
                        let p = EwParams {
                            rows: t,
                            n,
                            a_offset,
                            a_stride: lw,
                            out_offset,
                            out_stride,
                            ..Default::default()
                        };
                        ew(gpu, rec, EwKind::CopyRows, &p, &s.legacy, None, dst)?;
                    }
                }
            }
        }
        match &w.ba {
            BetaAlpha::Grouped(ba) => {
                rec.op("dn.ba", layer, dense_bytes(ba));
                self.mul(gpu, rec, s, ba, xn, cols(&s.gproj, cd, gw), t)?
            }
            BetaAlpha::Split { beta, alpha } => {
                rec.op("dn.ba", layer, dense_bytes(beta) + dense_bytes(alpha));
                self.mul(gpu, rec, s, beta, xn, cols(&s.gproj, cd, gw), t)?;
                self.mul(gpu, rec, s, alpha, xn, cols(&s.gproj, cd + nv, gw), t)?;
            }
        }
        let dp = delta_params(cfg);
        // Per slot: conv (advancing its rows) then the delta rule (advancing S).
        let run =
            |rec: &mut Recorder<'_>, st: &LayerState, first: u32, n: u32, base: Option<u32>| -> Result<()> {
                let LayerState::DeltaNet {
                    conv: conv_state,
                    conv_offset,
                    s: ssm,
                    s_offset,
                } = st
                else {
                    return Err(QkError::Engine("DeltaNet layer with attention state".into()));
                };
                let cp = ConvParams {
                    tokens: n,
                    channels: cd,
                    taps: cfg.conv_taps,
                    src_offset: first * gw,
                    src_token_stride: gw,
                    dst_offset: first * cd,
                    dst_token_stride: cd,
                    state_offset: (conv_offset / 4) as u32,
                };
                rec.op("dn.conv", layer, conv_bytes(cfg));
                conv::record(gpu, rec, &cp, &s.gproj, &w.conv, conv_state, &s.conv_out)?;
                let args = DeltaArgs {
                    qkv: &s.conv_out,
                    ba: &s.gproj,
                    ssm_a: &w.ssm_a,
                    dt_bias: &w.dt_bias,
                    state: ssm,
                    out: &s.dn_out,
                    scratch: Some(&s.dn_scratch),
                };
                let p = DeltaParams {
                    tokens: n,
                    first_token: first,
                    state_offset: (s_offset / 4) as u32,
                    ..dp
                };
                // S is read and written once per call.
                rec.op("dn.delta", layer, 2 * ssm_bytes(cfg));
                match base {
                    Some(b) => deltanet::record_prefill(gpu, rec, &p, b, &args),
                    None => deltanet::record_recurrent(gpu, rec, &p, &args),
                }
            };
        match batch {
            Batch::Prefill { base, n } => run(rec, states[0], 0, n, Some(base))?,
            Batch::Decode { positions } => {
                for (i, _) in positions.iter().enumerate() {
                    run(rec, states[i], i as u32, 1, None)?;
                }
            }
        }
        // Gated RMSNorm per v-head, then the output projection (docs/numerics.md "Gated DeltaNet" steps 8-9).
        let heads = RowLayout::packed(cfg.dv, nv);
        rec.op("dn.gated_norm", layer, 0);
        norm::record(
            gpu,
            rec,
            NormKind::RmsGated,
            &NormParams::new(t, nv, cfg.dv, heads, heads, cfg.eps, 1.0),
            &NormArgs {
                src: &s.dn_out,
                dst: &s.gated,
                weight: Some(&w.norm),
                other: Some(&s.z),
                sum: None,
            },
        )?;
        rec.op("dn.out", layer, dense_bytes(&w.out));
        self.mul(
            gpu,
            rec,
            s,
            &w.out,
            Columns::packed(&s.gated, vd),
            Columns::packed(&s.mix, e),
            t,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn record_attention(
        &self,
        gpu: &Gpu,
        rec: &mut Recorder<'_>,
        s: &Scratch,
        w: &super::weights::AttentionWeights,
        states: &[&LayerState],
        batch: Batch<'_>,
        layer: Option<u32>,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let t = batch.rows();
        let e = cfg.n_embd;
        let hd = cfg.head_dim;
        let (qw, kvw) = (2 * cfg.heads * hd, cfg.kv_row());
        let aw = attn_proj_width(cfg);
        let xn = Columns::packed(&s.xn, e);
        match &w.proj {
            AttnProjection::Separate { q, k, v } => {
                rec.op(
                    "attn.qkv",
                    layer,
                    dense_bytes(q) + dense_bytes(k) + dense_bytes(v),
                );
                self.mul(gpu, rec, s, q, xn, cols(&s.aproj, 0, aw), t)?;
                self.mul(gpu, rec, s, k, xn, cols(&s.aproj, qw, aw), t)?;
                self.mul(gpu, rec, s, v, xn, cols(&s.aproj, qw + kvw, aw), t)?;
            }
            AttnProjection::Fused(qkv) => {
                rec.op("attn.qkv", layer, dense_bytes(qkv));
                self.mul(gpu, rec, s, qkv, xn, cols(&s.aproj, 0, aw), t)?
            }
        }
        self.record_attention_core(gpu, rec, s, w, states, batch, layer)?;
        let q_rows = cfg.heads * hd;
        rec.op("attn.out", layer, dense_bytes(&w.out));
        self.mul(
            gpu,
            rec,
            s,
            &w.out,
            Columns::packed(&s.attn_out, q_rows),
            Columns::packed(&s.mix, e),
            t,
        )
    }

    /// From the projections in `s.aproj` to the gated attention output in `s.attn_out`: q/k norms,
    /// RoPE and the K/V store into the slots' caches (one prepare dispatch), then attention.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn record_attention_core(
        &self,
        gpu: &Gpu,
        rec: &mut Recorder<'_>,
        s: &Scratch,
        w: &super::weights::AttentionWeights,
        states: &[&LayerState],
        batch: Batch<'_>,
        layer: Option<u32>,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let t = batch.rows();
        let hd = cfg.head_dim;
        let (qw, kvw) = (2 * cfg.heads * hd, cfg.kv_row());
        let aw = attn_proj_width(cfg);
        let Some(LayerState::Attention { kv, slot }) = states.first() else {
            return Err(QkError::Engine("attention layer without its KV state".into()));
        };
        let shape = kv.shape;
        let groups = kv.views();
        let q_rows = cfg.heads * hd;
        // [q_h | gate_h] per head, then K, then V (attn_proj_width).
        let prep = PrepareArgs {
            proj: &s.aproj,
            layout: ProjLayout {
                row_stride: aw,
                q_offset: 0,
                q_head_stride: 2 * hd,
                k_offset: qw,
                v_offset: qw + kvw,
            },
            q_norm: &w.q_norm,
            k_norm: &w.k_norm,
            freqs: &self.freqs,
            q_out: &s.q,
        };
        let core = CoreArgs {
            q: &s.q,
            gate: Some((
                &s.aproj,
                GateLayout {
                    offset: hd,
                    row_stride: aw,
                    head_stride: 2 * hd,
                },
            )),
            out: &s.attn_out,
            out_layout: OutLayout {
                offset: 0,
                row_stride: q_rows,
            },
            part_o: &s.part_out,
            part_ml: &s.part_ml,
        };
        let kv_bytes = |keys: u64| keys * (shape.k_position_bytes() + shape.v_position_bytes());
        match batch {
            Batch::Prefill { base, n } => {
                rec.op("attn.prepare", layer, 0);
                let rows = AttnRows::Piece {
                    slot: *slot,
                    pos: base,
                    n,
                };
                attention::record_prepare(gpu, rec, &shape, rows, &groups, &prep)?;
                rec.op("attn.core", layer, kv_bytes(u64::from(base + n)));
                let kernel = attention::prefill_kernel(gpu, &shape, self.precision);
                attention::record_prefill(gpu, rec, &shape, *slot, base, n, &groups, &core, kernel)?;
            }
            Batch::Decode { positions } => {
                rec.op("attn.prepare", layer, 0);
                let rows = AttnRows::Step {
                    buf: &s.attn_rows,
                    n: t,
                };
                attention::record_prepare(gpu, rec, &shape, rows, &groups, &prep)?;
                let keys: u64 = positions.iter().map(|&p| u64::from(p) + 1).sum();
                rec.op("attn.core", layer, kv_bytes(keys));
                let walk = self.attention_walk;
                attention::record_decode(gpu, rec, &shape, &s.attn_rows, t, &groups, &core, walk)?;
            }
        }
        Ok(())
    }

    /// MoE + shared expert of the normed rows in xn, added to `out` (docs/numerics.md "MoE routing").
    #[allow(clippy::too_many_arguments)]
    fn record_moe(
        &self,
        gpu: &Gpu,
        rec: &mut Recorder<'_>,
        s: &Scratch,
        lw: &LayerWeights,
        t: u32,
        out: &GpuBuffer,
        layer: Option<u32>,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let w = &lw.moe;
        let e = cfg.n_embd;
        let (k, ff, sff) = (cfg.experts_used, cfg.expert_ff, cfg.shared_ff);
        let xn = Columns::packed(&s.xn, e);
        rec.op("moe.router_mv", layer, w.router.bytes());
        // The shared expert's gate logit: beside the expert logits when the router is stacked.
        let (logit_stride, gate_buf, gate_offset, gate_stride) = match &w.router {
            Stacked::One(router) => {
                let stride = cfg.experts + 1;
                self.mul(
                    gpu,
                    rec,
                    s,
                    router,
                    xn,
                    Columns::packed(&s.router_logits, stride),
                    t,
                )?;
                (stride, &s.router_logits, cfg.experts, stride)
            }
            Stacked::Parts(parts) => {
                let [router, gate_inp] = parts.as_slice() else {
                    return Err(QkError::Engine("router: expected router and shared gate".into()));
                };
                let logits = Columns::packed(&s.router_logits, cfg.experts);
                self.mul(gpu, rec, s, router, xn, logits, t)?;
                self.mul(gpu, rec, s, gate_inp, xn, Columns::packed(&s.sh_gate, 1), t)?;
                (cfg.experts, &s.sh_gate, 0, 1)
            }
        };
        let rp = RouterParams {
            tokens: t,
            experts: cfg.experts,
            k,
            logits_offset: 0,
            logits_token_stride: logit_stride,
        };
        rec.op("moe.route", layer, 0);
        router::record(gpu, rec, &rp, &s.router_logits, &s.expert_ids, &s.expert_w)?;
        let ids = ExpertIds {
            buf: &s.expert_ids,
            offset: 0,
            n_used: k,
            n_tokens: t,
        };
        // Beyond the mat-vec's columns the batch's entries are grouped by expert once, for the
        // grouped mat-mats of gate/up and down, in tiles as wide as all of them take.
        let stack_types = match &w.gate_up {
            ExpertGateUp::Separate { gate, up } => [gate.ty, up.ty, w.down.ty],
            ExpertGateUp::Fused(gu) => [gu.ty, gu.ty, w.down.ty],
        };
        let groups = ExpertGroups {
            buf: &s.expert_groups,
            shape: GroupShape {
                experts: cfg.experts,
                n_used: k,
                n_tokens: t,
                tile_cols: moe_tile_cols(gpu, self.precision, &stack_types, cfg.experts, k, t),
            },
        };
        if column_class(gpu, self.precision, t) != ColumnClass::MatVec {
            rec.op("moe.group", layer, 0);
            group_experts(gpu, rec, ids, groups)?;
        }
        let experts = |rec: &mut Recorder<'_>, w: &WeightTensor, x, y, input| {
            mul_id(gpu, rec, w, x, y, ids, groups, input, self.precision)
        };
        match &w.gate_up {
            ExpertGateUp::Separate { gate, up } => {
                rec.op(
                    "moe.gate_up",
                    layer,
                    expert_bytes(gate, k, t) + expert_bytes(up, k, t),
                );
                experts(rec, gate, xn, cols(&s.gate_up, 0, 2 * ff), MoeInput::PerToken)?;
                experts(rec, up, xn, cols(&s.gate_up, ff, 2 * ff), MoeInput::PerToken)?;
            }
            ExpertGateUp::Fused(gu) => {
                rec.op("moe.gate_up", layer, expert_bytes(gu, k, t));
                experts(rec, gu, xn, cols(&s.gate_up, 0, 2 * ff), MoeInput::PerToken)?;
            }
        }
        let silu = |rows: u32, n: u32| EwParams {
            rows,
            n,
            a_offset: 0,
            a_stride: 2 * n,
            b_offset: n,
            b_stride: 2 * n,
            out_offset: 0,
            out_stride: n,
            ..Default::default()
        };
        // With ff == shared_ff (every Qwen3-Next / Qwen3.5-MoE shape) the shared expert's gate/up
        // rows sit after the t·k expert columns of gate_up, so one SiLU·mul covers both.
        let joint = ff == sff;
        let (sh_gu, sh_gu_offset, sh_act, sh_act_offset) = if joint {
            (&s.gate_up, t * k * 2 * ff, &s.act, t * k * ff)
        } else {
            (&s.sh_gate_up, 0, &s.sh_act, 0)
        };
        rec.op("shexp.gate_up", layer, w.shared_gate_up.bytes());
        match &w.shared_gate_up {
            Stacked::One(gu) => self.mul(gpu, rec, s, gu, xn, cols(sh_gu, sh_gu_offset, 2 * sff), t)?,
            Stacked::Parts(parts) => {
                let [gate, up] = parts.as_slice() else {
                    return Err(QkError::Engine("shared expert: expected gate and up".into()));
                };
                self.mul(gpu, rec, s, gate, xn, cols(sh_gu, sh_gu_offset, 2 * sff), t)?;
                self.mul(gpu, rec, s, up, xn, cols(sh_gu, sh_gu_offset + sff, 2 * sff), t)?;
            }
        }
        let expert_rows = if joint { t * k + t } else { t * k };
        rec.op("moe.silu", layer, 0);
        ew(
            gpu,
            rec,
            EwKind::SiluMul,
            &silu(expert_rows, ff),
            &s.gate_up,
            Some(&s.gate_up),
            &s.act,
        )?;
        if !joint {
            rec.op("shexp.silu", layer, 0);
            ew(
                gpu,
                rec,
                EwKind::SiluMul,
                &silu(t, sff),
                &s.sh_gate_up,
                Some(&s.sh_gate_up),
                &s.sh_act,
            )?;
        }
        rec.op("moe.down", layer, expert_bytes(&w.down, k, t));
        experts(
            rec,
            &w.down,
            Columns::packed(&s.act, ff),
            Columns::packed(&s.down, e),
            MoeInput::PerSlot,
        )?;
        rec.op("shexp.down", layer, dense_bytes(&w.shared_down));
        self.mul(
            gpu,
            rec,
            s,
            &w.shared_down,
            cols(sh_act, sh_act_offset, sff),
            Columns::packed(&s.sh_down, e),
            t,
        )?;
        let cp = EwParams {
            rows: t,
            n: e,
            a_offset: 0,
            a_stride: k * e,
            b_offset: 0,
            b_stride: e,
            out_offset: 0,
            out_stride: e,
            weights_offset: 0,
            weights_stride: k,
            experts: k,
            accumulate: 1,
            gate_offset,
            gate_stride,
        };
        rec.op("moe.combine", layer, 0);
        elementwise::record(
            gpu,
            rec,
            EwKind::MoeCombine,
            &cp,
            &EwArgs {
                a: &s.down,
                b: Some(&s.sh_down),
                out,
                weights: Some(&s.expert_w),
                gate: Some(gate_buf),
            },
        )
    }

    /// Final norm and LM head of rows in x[cur] into `s.logits` ([rows, vocab]).
    pub fn record_head(
        &self,
        gpu: &Gpu,
        rec: &mut Recorder<'_>,
        s: &Scratch,
        cur: usize,
        t: u32,
    ) -> Result<()> {
        self.record_head_rows(gpu, rec, s, cur, 0, t)
    }

    /// Final norm and LM head of rows [first, first + t) of x[cur] into rows 0..t of `s.logits`.
    pub fn record_head_rows(
        &self,
        gpu: &Gpu,
        rec: &mut Recorder<'_>,
        s: &Scratch,
        cur: usize,
        first: u32,
        t: u32,
    ) -> Result<()> {
        crate::ensure!(
            t <= s.head_rows,
            QkError::Engine(format!("LM head over {t} rows: logits hold {}", s.head_rows))
        );
        let (norm_w, head) = match (&self.weights.output_norm, &self.weights.output) {
            (Some(n), Some(h)) => (n, h),
            _ => {
                return Err(QkError::Engine(
                    "this stage has no LM head (layers do not end at n_layer)".into(),
                ));
            }
        };
        let e = self.cfg.n_embd;
        let rows_e = RowLayout::packed(e, 1);
        let src = RowLayout {
            offset: first * e,
            ..rows_e
        };
        rec.op("head.norm", None, 0);
        norm::record(
            gpu,
            rec,
            NormKind::Rms,
            &NormParams::new(t, 1, e, src, rows_e, self.cfg.eps, 1.0),
            &NormArgs {
                src: &s.x[cur],
                dst: &s.xn,
                weight: Some(norm_w),
                other: None,
                sum: None,
            },
        )?;
        // mat-vec for a few rows (weights read once for all of them), tiled mat-mat for more.
        rec.op("head.lm", None, dense_bytes(head));
        self.mul(
            gpu,
            rec,
            s,
            head,
            Columns::packed(&s.xn, e),
            Columns::packed(&s.logits, self.cfg.vocab),
            t,
        )
    }

    /// Top-k of logits rows [first, first + rows) in one pair of dispatches: row first + r's k
    /// pairs land at pair r·k of `result` (`s.results` or `s.result_last`).
    #[allow(clippy::too_many_arguments)]
    pub fn record_topk_rows(
        &self,
        gpu: &Gpu,
        rec: &mut Recorder<'_>,
        s: &Scratch,
        first: u32,
        rows: u32,
        k: u32,
        result: &GpuBuffer,
    ) -> Result<()> {
        crate::ensure!(
            first + rows <= s.head_rows,
            QkError::Engine(format!("top-k rows {first}..{} beyond the logits", first + rows))
        );
        let p = TopkParams::new(self.cfg.vocab, k, first * self.cfg.vocab)?;
        rec.op("head.topk", None, u64::from(rows) * u64::from(self.cfg.vocab) * 4);
        topk::record_rows(gpu, rec, &p, rows, &s.logits, &s.topk_candidates, result)
    }
}
