//! The decode step's layers: one position for each of several slots, recorded from fused kernels.
//! Per layer, the norms run inside the mat-vecs that consume them, the GDN conv in its projection's
//! epilogue (an F32 beta/alpha projection in extra workgroups of the same dispatch), the delta rule
//! and output gate in one dispatch over every row (the gated norm's per-head RMS finished in the
//! output projection), the residual adds in the output projections, and the shared expert as one
//! more routed pick (its rows appended to the expert tensors at load), so a multi-slot step issues
//! the same dispatches as a one-slot step.
//! A layer the fused path cannot take (a legacy `ssm_in` projection, head dims beyond one
//! workgroup) runs the general recording of `forward.rs` instead; layers hand over through the
//! hidden state in `x`, so the two mix freely.

use super::forward::{
    Batch, LayerState, Model, Scratch, SlotState, attn_proj_width, cols, conv_bytes, delta_params,
    dense_bytes, expert_bytes, ssm_bytes,
};
use super::weights::{
    AttentionWeights, AttnProjection, BetaAlpha, DeltaNetProjection, DeltaNetWeights, ExpertGateUp,
    LayerWeights, Mixer, MoeWeights, Stacked,
};
use crate::error::{QkError, Result};
use crate::gpu::{Gpu, GpuBuffer, Recorder, WeightTensor};
use crate::ops::elementwise::{self, EwArgs, EwKind, EwParams};
use crate::ops::gdn_step::{self, GdnStepArgs, GdnStepParams};
use crate::ops::matmul::{
    Columns, ExpertIds, MatvecFusion, MatvecInput, MatvecLaunch, MatvecOutput, MatvecShape, MoeInput,
    MoeRoute, matvec_coop, matvec_coop_fits, matvec_id_routed, matvec_id_sum, matvec_id_with, matvec_shaped,
    route_lanes, takes_f32_rows,
};
use crate::ops::router::{self, RouterParams, SharedSlot};

/// The decode step's ops whose mat-vecs [`EngineOptions::decode_shapes`] may shape (the
/// profile's op names): the dense ones, then the experts' ([`EXPERT_DECODE_OPS`]).
///
/// [`EngineOptions::decode_shapes`]: crate::engine::EngineOptions::decode_shapes
pub const SHAPED_DECODE_OPS: [&str; 12] = [
    "dn.qkvz",
    "dn.qkv",
    "dn.gate",
    "dn.ba",
    "attn.qkv",
    "dn.out",
    "attn.out",
    "moe.router_mv",
    "shexp.gate_up",
    "shexp.down",
    "moe.gate_up",
    "moe.down",
];

/// The expert products among [`SHAPED_DECODE_OPS`]: one column per workgroup already, so never in
/// column groups.
pub const EXPERT_DECODE_OPS: [&str; 2] = ["moe.gate_up", "moe.down"];

impl Model {
    /// Every local layer for one position of each slot in `states` (row i: `states[i]`, whose slot
    /// index the engine wrote to `s.slots[i]`, at `positions[i]`), starting from the rows in x[0];
    /// returns the index of the x buffer holding the output.
    pub fn record_decode_layers(
        &self,
        gpu: &Gpu,
        rec: &mut Recorder<'_>,
        s: &Scratch,
        states: &[&SlotState],
        positions: &[u32],
    ) -> Result<usize> {
        crate::ensure!(
            states.len() == positions.len() && !states.is_empty() && states.len() <= s.rows as usize,
            QkError::Engine(format!(
                "decode: {} slot states for {} positions (scratch of {} rows)",
                states.len(),
                positions.len(),
                s.rows
            ))
        );
        let mut cur = 0usize;
        for (li, lw) in self.weights.layers.iter().enumerate() {
            let layer_states: Vec<&LayerState> = states.iter().map(|st| &st.layers[li]).collect();
            if self.fused_decode(lw) {
                self.record_decode_layer(gpu, rec, s, lw, &layer_states, positions, cur)?;
            } else {
                let batch = Batch::Decode { positions };
                self.record_layer(gpu, rec, s, lw, &layer_states, batch, cur)?;
            }
            cur = 1 - cur;
        }
        Ok(cur)
    }

    /// Whether the fused kernels cover this layer.
    fn fused_decode(&self, lw: &LayerWeights) -> bool {
        let cfg = &self.cfg;
        let mixer_ok = match &lw.mixer {
            Mixer::DeltaNet(w) => {
                matches!(&w.proj, DeltaNetProjection::Split { qkv, .. } if qkv.windows.len() == 1)
                    && cfg.dk <= gdn_step::MAX_DK
                    && cfg.dv <= gdn_step::MAX_DV
            }
            Mixer::Attention(_) => true,
        };
        let router_ok = match &lw.moe.router {
            Stacked::One(r) => r.windows.len() == 1,
            Stacked::Parts(p) => p.iter().all(|r| r.windows.len() == 1),
        };
        mixer_ok && router_ok && matches!(lw.moe.gate_up, ExpertGateUp::Fused(_))
    }

    /// The launch shape the engine was given for the op named last (`decode_shapes`), if any.
    fn given_shape(&self, rec: &Recorder<'_>) -> Option<MatvecShape> {
        let op = rec.op_name();
        self.decode_shapes
            .iter()
            .find(|(name, _)| name == op)
            .map(|(_, shape)| *shape)
    }

    /// Whether a step of `t` rows runs `w`'s product with these stages on tensor cores
    /// (`tensor_core_decode_cols`).
    fn on_tensor_cores(&self, gpu: &Gpu, w: &WeightTensor, t: u32, fusion: &MatvecFusion<'_>) -> bool {
        self.tensor_core_decode_cols.is_some_and(|n| t >= n) && matvec_coop_fits(gpu, w, t, fusion)
    }

    /// One of the step's dense mat-vecs (`extra`: F32 rows riding in its dispatch, as
    /// [`matvec_shaped`]), launched in the shape the engine was given for the op named last
    /// (`decode_shapes`), else on tensor cores where the engine was told to
    /// (`tensor_core_decode_cols`), else with its columns grouped as it was told
    /// (`dense_group_cols`).
    #[allow(clippy::too_many_arguments)]
    fn dense(
        &self,
        gpu: &Gpu,
        rec: &mut Recorder<'_>,
        w: &WeightTensor,
        extra: Option<&WeightTensor>,
        x: Columns<'_>,
        y: Columns<'_>,
        t: u32,
        fusion: &MatvecFusion<'_>,
    ) -> Result<()> {
        let launch = match self.given_shape(rec) {
            Some(shape) => MatvecLaunch::Shape(shape),
            None if extra.is_none() && self.on_tensor_cores(gpu, w, t, fusion) => {
                return matvec_coop(gpu, rec, w, x, y, t, fusion);
            }
            None => MatvecLaunch::ForMatrix {
                group_cols: self.dense_group_cols,
            },
        };
        matvec_shaped(gpu, rec, w, extra, x, y, t, fusion, launch)
    }

    #[allow(clippy::too_many_arguments)]
    fn record_decode_layer(
        &self,
        gpu: &Gpu,
        rec: &mut Recorder<'_>,
        s: &Scratch,
        lw: &LayerWeights,
        states: &[&LayerState],
        positions: &[u32],
        cur: usize,
    ) -> Result<()> {
        let t = positions.len() as u32;
        let e = self.cfg.n_embd;
        let (x, x_next) = (&s.x[cur], &s.x[1 - cur]);
        let layer = Some(lw.index);
        let normed = MatvecInput::Rms {
            weight: &lw.attn_norm,
            eps: self.cfg.eps,
            store: None,
        };
        // The mixer's output projection adds the residual: x_next = x + mixer(x). After the GDN
        // step it also finishes the gated norm (each head's RMS from the step's sums of squares).
        let (out_w, out_x, out_k, out_input) = match &lw.mixer {
            Mixer::DeltaNet(w) => {
                let head_rms = self.decode_deltanet(gpu, rec, s, w, states, normed, x, t, layer)?;
                (&w.out, &s.gated, self.cfg.value_dim(), head_rms)
            }
            Mixer::Attention(w) => {
                self.decode_attention(gpu, rec, s, w, states, positions, normed, x, t, layer)?;
                let hd = self.cfg.heads * self.cfg.head_dim;
                (&w.out, &s.attn_out, hd, MatvecInput::Plain)
            }
        };
        rec.op(
            if matches!(lw.mixer, Mixer::DeltaNet(_)) {
                "dn.out"
            } else {
                "attn.out"
            },
            layer,
            dense_bytes(out_w),
        );
        let add = MatvecFusion {
            input: out_input,
            output: MatvecOutput::AddTo { residual: x },
        };
        self.dense(
            gpu,
            rec,
            out_w,
            None,
            Columns::packed(out_x, out_k),
            Columns::packed(x_next, e),
            t,
            &add,
        )?;
        self.decode_moe(gpu, rec, s, lw, t, x_next, layer)
    }

    /// Projections (norm fused; the conv in the qkv epilogue), then delta rule + output gate;
    /// returns the output projection's input stage that finishes the gated norm from the sums of
    /// squares the step wrote.
    #[allow(clippy::too_many_arguments)]
    fn decode_deltanet<'s>(
        &self,
        gpu: &Gpu,
        rec: &mut Recorder<'_>,
        s: &'s Scratch,
        w: &DeltaNetWeights,
        states: &[&LayerState],
        normed: MatvecInput<'_>,
        x: &GpuBuffer,
        t: u32,
        layer: Option<u32>,
    ) -> Result<MatvecInput<'s>> {
        let cfg = &self.cfg;
        let (cd, vd, nv, e) = (cfg.conv_dim(), cfg.value_dim(), cfg.v_heads, cfg.n_embd);
        // One row of s.dn_proj: [conv(q ‖ k ‖ v) | z | beta/alpha logits].
        let pw = cd + vd + 2 * nv;
        let xc = Columns::packed(x, e);
        let DeltaNetProjection::Split { qkv, gate, stacked } = &w.proj else {
            return Err(QkError::Engine("fused decode: legacy ssm_in projection".into()));
        };
        let Some(LayerState::DeltaNet { conv, s: ssm, .. }) = states.first() else {
            return Err(QkError::Engine("DeltaNet layer with attention state".into()));
        };
        let conv_fusion = MatvecFusion {
            input: normed,
            output: MatvecOutput::Conv {
                weights: &w.conv,
                state: conv,
                slots: &s.slots,
                slots_offset: 0,
                channels: cd,
                taps: cfg.conv_taps,
                state_stride: (conv_bytes(cfg) / 4) as u32,
            },
        };
        let plain_norm = MatvecFusion {
            input: normed,
            output: MatvecOutput::Store,
        };
        // An F32 beta/alpha projection (as GGUF files keep it) rides in the dispatch of the
        // product whose rows its own follow: one dispatch fewer per layer.
        let f32_ba = match &w.ba {
            BetaAlpha::Grouped(ba) => Some(ba),
            BetaAlpha::Split { .. } => None,
        };
        let last = stacked.as_ref().unwrap_or(gate);
        // Not beside a product on tensor cores, whose kernel has no F32 rows.
        let ba_rides =
            f32_ba.filter(|ba| takes_f32_rows(last, ba) && !self.on_tensor_cores(gpu, last, t, &plain_norm));
        let ba_bytes = ba_rides.map_or(0, dense_bytes);
        match stacked {
            // q ‖ k ‖ v ‖ z in one product; the conv runs on the first cd rows.
            Some(both) => {
                rec.op("dn.qkvz", layer, dense_bytes(both) + ba_bytes);
                let y = cols(&s.dn_proj, 0, pw);
                self.dense(gpu, rec, both, ba_rides, xc, y, t, &conv_fusion)?;
            }
            None => {
                rec.op("dn.qkv", layer, dense_bytes(qkv));
                self.dense(gpu, rec, qkv, None, xc, cols(&s.dn_proj, 0, pw), t, &conv_fusion)?;
                rec.op("dn.gate", layer, dense_bytes(gate) + ba_bytes);
                let y = cols(&s.dn_proj, cd, pw);
                self.dense(gpu, rec, gate, ba_rides, xc, y, t, &plain_norm)?;
            }
        }
        let ba_at = cd + vd;
        match &w.ba {
            BetaAlpha::Grouped(_) if ba_rides.is_some() => {}
            BetaAlpha::Grouped(ba) => {
                rec.op("dn.ba", layer, dense_bytes(ba));
                self.dense(
                    gpu,
                    rec,
                    ba,
                    None,
                    xc,
                    cols(&s.dn_proj, ba_at, pw),
                    t,
                    &plain_norm,
                )?;
            }
            BetaAlpha::Split { beta, alpha } => {
                rec.op("dn.ba", layer, dense_bytes(beta) + dense_bytes(alpha));
                self.dense(
                    gpu,
                    rec,
                    beta,
                    None,
                    xc,
                    cols(&s.dn_proj, ba_at, pw),
                    t,
                    &plain_norm,
                )?;
                self.dense(
                    gpu,
                    rec,
                    alpha,
                    None,
                    xc,
                    cols(&s.dn_proj, ba_at + nv, pw),
                    t,
                    &plain_norm,
                )?;
            }
        }
        let dp = delta_params(cfg);
        // The step's sums of o²: `parts` per head, one row of them per slot.
        let parts = gdn_step::parts(gpu, dp.dv);
        let p = GdnStepParams {
            rows: t,
            k_heads: dp.k_heads,
            v_heads: dp.v_heads,
            dk: dp.dk,
            dv: dp.dv,
            pairing: dp.pairing,
            qkv_offset: 0,
            qkv_stride: pw,
            q_offset: dp.q_offset,
            k_offset: dp.k_offset,
            v_offset: dp.v_offset,
            // delta_params places beta/alpha after the cd conv channels; here they follow z too.
            ba_offset: 0,
            ba_stride: pw,
            ba_group: dp.ba_group,
            ba_group_stride: dp.ba_group_stride,
            beta_offset: dp.beta_offset + vd,
            alpha_offset: dp.alpha_offset + vd,
            z_offset: cd,
            z_stride: pw,
            out_offset: 0,
            out_stride: vd,
            state_stride: (ssm_bytes(cfg) / 4) as u32,
            slots_offset: 0,
            parts: 0,
            sq_offset: 0,
            sq_stride: nv * parts,
            eps: dp.eps,
            q_scale: dp.q_scale,
        };
        rec.op("dn.step", layer, 2 * ssm_bytes(cfg) * u64::from(t));
        gdn_step::record(
            gpu,
            rec,
            &p,
            &GdnStepArgs {
                qkv: &s.dn_proj,
                ba: &s.dn_proj,
                ssm_a: &w.ssm_a,
                dt_bias: &w.dt_bias,
                z: &s.dn_proj,
                norm: &w.norm,
                sq: &s.gated_sums,
                slots: &s.slots,
                state: ssm,
                out: &s.gated,
            },
        )?;
        Ok(MatvecInput::HeadRms {
            sums: &s.gated_sums,
            heads: nv,
            head_dim: dp.dv,
            parts,
            offset: 0,
            stride: nv * parts,
            eps: cfg.eps,
        })
    }

    /// The q/k/v/gate projection (norm fused), then the per-slot attention core into `s.attn_out`.
    #[allow(clippy::too_many_arguments)]
    fn decode_attention(
        &self,
        gpu: &Gpu,
        rec: &mut Recorder<'_>,
        s: &Scratch,
        w: &AttentionWeights,
        states: &[&LayerState],
        positions: &[u32],
        normed: MatvecInput<'_>,
        x: &GpuBuffer,
        t: u32,
        layer: Option<u32>,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let (hd, e) = (cfg.head_dim, cfg.n_embd);
        let (qw, kvw) = (2 * cfg.heads * hd, cfg.kv_row());
        let aw = attn_proj_width(cfg);
        let xc = Columns::packed(x, e);
        let fusion = MatvecFusion {
            input: normed,
            output: MatvecOutput::Store,
        };
        match &w.proj {
            AttnProjection::Separate { q, k, v } => {
                rec.op(
                    "attn.qkv",
                    layer,
                    dense_bytes(q) + dense_bytes(k) + dense_bytes(v),
                );
                self.dense(gpu, rec, q, None, xc, cols(&s.aproj, 0, aw), t, &fusion)?;
                self.dense(gpu, rec, k, None, xc, cols(&s.aproj, qw, aw), t, &fusion)?;
                self.dense(gpu, rec, v, None, xc, cols(&s.aproj, qw + kvw, aw), t, &fusion)?;
            }
            AttnProjection::Fused(qkv) => {
                rec.op("attn.qkv", layer, dense_bytes(qkv));
                self.dense(gpu, rec, qkv, None, xc, cols(&s.aproj, 0, aw), t, &fusion)?;
            }
        }
        self.record_attention_core(gpu, rec, s, w, states, Batch::Decode { positions }, layer)
    }

    /// Router (post-attention norm fused, the normalised rows kept in `s.xn`), top-k with the shared
    /// expert as pick k, the experts' gate/up, their down projections reading silu(gate)·up, and the
    /// weighted sum added to `out` (which holds the residual stream already).
    #[allow(clippy::too_many_arguments)]
    fn decode_moe(
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
        let w: &MoeWeights = &lw.moe;
        let e = cfg.n_embd;
        let (k, ff, ne) = (cfg.experts_used, cfg.expert_ff, cfg.experts);
        let ExpertGateUp::Fused(gate_up) = &w.gate_up else {
            return Err(QkError::Engine(
                "fused decode: separate gate and up experts".into(),
            ));
        };
        let xc = Columns::packed(out, e);
        let norm_store = MatvecFusion {
            input: MatvecInput::Rms {
                weight: &lw.post_norm,
                eps: cfg.eps,
                store: Some(&s.xn),
            },
            output: MatvecOutput::Store,
        };
        rec.op("moe.router_mv", layer, w.router.bytes());
        let (stride, gate_buf, gate_offset, gate_stride) = match &w.router {
            Stacked::One(r) => {
                let stride = ne + 1;
                self.dense(
                    gpu,
                    rec,
                    r,
                    None,
                    xc,
                    Columns::packed(&s.router_logits, stride),
                    t,
                    &norm_store,
                )?;
                (stride, &s.router_logits, ne, stride)
            }
            Stacked::Parts(parts) => {
                let [r, gate_inp] = parts.as_slice() else {
                    return Err(QkError::Engine("router: expected router and shared gate".into()));
                };
                self.dense(
                    gpu,
                    rec,
                    r,
                    None,
                    xc,
                    Columns::packed(&s.router_logits, ne),
                    t,
                    &norm_store,
                )?;
                let normed = MatvecFusion {
                    input: MatvecInput::Rms {
                        weight: &lw.post_norm,
                        eps: cfg.eps,
                        store: None,
                    },
                    output: MatvecOutput::Store,
                };
                self.dense(
                    gpu,
                    rec,
                    gate_inp,
                    None,
                    xc,
                    Columns::packed(&s.sh_gate, 1),
                    t,
                    &normed,
                )?;
                (ne, &s.sh_gate, 0, 1)
            }
        };
        let shared = w.shared_in_experts.then_some(SharedSlot {
            id: ne,
            gate: gate_buf,
            gate_offset,
            gate_stride,
        });
        let picks = k + u32::from(shared.is_some());
        let ids = ExpertIds {
            buf: &s.expert_ids,
            offset: 0,
            n_used: picks,
            n_tokens: t,
        };
        let xn = Columns::packed(&s.xn, e);
        let gu_out = cols(&s.gate_up, 0, 2 * ff);
        // With the shared gate logit beside the expert logits (a stacked router), the gate/up
        // product routes its tokens itself where the device can: one dispatch fewer per layer, but
        // every workgroup of the product routes its token (see `route_inside_max_rows`).
        let stacked_router = matches!(w.router, Stacked::One(_));
        if stacked_router && route_lanes(gpu, ne).is_some() && t <= self.route_inside_max_rows {
            let route = MoeRoute {
                logits: &s.router_logits,
                offset: 0,
                stride,
                experts: ne,
                shared: shared.is_some(),
                weights: &s.expert_w,
            };
            rec.op("moe.gate_up", layer, expert_bytes(gate_up, picks, t));
            let shape = self.given_shape(rec);
            matvec_id_routed(gpu, rec, gate_up, xn, gu_out, ids, &route, shape)?;
        } else {
            let rp = RouterParams {
                tokens: t,
                experts: ne,
                k,
                logits_offset: 0,
                logits_token_stride: stride,
            };
            rec.op("moe.route", layer, 0);
            router::record_with(
                gpu,
                rec,
                &rp,
                &s.router_logits,
                &s.expert_ids,
                &s.expert_w,
                shared,
            )?;
            rec.op("moe.gate_up", layer, expert_bytes(gate_up, picks, t));
            matvec_id_with(
                gpu,
                rec,
                gate_up,
                xn,
                gu_out,
                ids,
                MoeInput::PerToken,
                MatvecInput::Plain,
                self.given_shape(rec),
            )?;
        }
        rec.op("moe.down", layer, expert_bytes(&w.down, picks, t));
        let silu_mul = MatvecInput::SiluMul { up: ff };
        let gu = Columns::packed(&s.gate_up, 2 * ff);
        if shared.is_some() {
            // Every pick's down projection, weighted and added to the residual stream in `out`.
            let shape = self.given_shape(rec);
            return matvec_id_sum(gpu, rec, &w.down, gu, xc, ids, &s.expert_w, silu_mul, shape);
        }
        let down = Columns::packed(&s.down, e);
        matvec_id_with(
            gpu,
            rec,
            &w.down,
            gu,
            down,
            ids,
            MoeInput::PerSlot,
            silu_mul,
            self.given_shape(rec),
        )?;
        let mut p = EwParams {
            rows: t,
            n: e,
            a_offset: 0,
            a_stride: picks * e,
            b_offset: 0,
            b_stride: e,
            out_offset: 0,
            out_stride: e,
            weights_offset: 0,
            weights_stride: picks,
            experts: picks,
            accumulate: 1,
            gate_offset,
            gate_stride,
        };
        // The shared expert on its own: its gate/up from the stored normalised rows, its down
        // reading silu(gate)·up, then the combine with its sigmoid gate.
        let sff = cfg.shared_ff;
        rec.op("shexp.gate_up", layer, w.shared_gate_up.bytes());
        match &w.shared_gate_up {
            Stacked::One(gu) => {
                let y = Columns::packed(&s.sh_gate_up, 2 * sff);
                self.dense(gpu, rec, gu, None, xn, y, t, &MatvecFusion::default())?;
            }
            Stacked::Parts(parts) => {
                let [gate, up] = parts.as_slice() else {
                    return Err(QkError::Engine("shared expert: expected gate and up".into()));
                };
                self.dense(
                    gpu,
                    rec,
                    gate,
                    None,
                    xn,
                    cols(&s.sh_gate_up, 0, 2 * sff),
                    t,
                    &MatvecFusion::default(),
                )?;
                self.dense(
                    gpu,
                    rec,
                    up,
                    None,
                    xn,
                    cols(&s.sh_gate_up, sff, 2 * sff),
                    t,
                    &MatvecFusion::default(),
                )?;
            }
        }
        rec.op("shexp.down", layer, dense_bytes(&w.shared_down));
        let silu_mul = MatvecFusion {
            input: MatvecInput::SiluMul { up: sff },
            output: MatvecOutput::Store,
        };
        let sh_gu = Columns::packed(&s.sh_gate_up, 2 * sff);
        self.dense(
            gpu,
            rec,
            &w.shared_down,
            None,
            sh_gu,
            Columns::packed(&s.sh_down, e),
            t,
            &silu_mul,
        )?;
        p.a_stride = k * e;
        rec.op("moe.combine", layer, 0);
        let args = EwArgs {
            a: &s.down,
            b: Some(&s.sh_down),
            out,
            weights: Some(&s.expert_w),
            gate: Some(gate_buf),
        };
        elementwise::record(gpu, rec, EwKind::MoeCombine, &p, &args)
    }
}
