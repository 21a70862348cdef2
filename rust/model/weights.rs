//! Device-resident weights of a layer range [a, b) (docs/numerics.md "Tensors"): the embedding when a == 0,
//! the final norm and LM head when b == n_layer (the head falls back to the embedding when the
//! file has no `output.weight`). Matrices stay in their GGUF block layout; norms and small vectors
//! are uploaded as f32. MTP blocks after the main stack are never read.
//!
//! Matrices that read the same input and write adjacent outputs are stacked row-wise at load when
//! they share a type (attention q ‖ k ‖ v, beta ‖ alpha, router ‖ shared-expert gate, shared gate ‖
//! up, expert gate ‖ up per expert): one mat-vec dispatch reads them all, and every output row is
//! the same dot product as before, so results keep their bits.
//!
//! With a [`WeightArena`] (the engine's default), the small tensors are ranges of a few shared
//! buffers (see there: the submit of a step costs the host per buffer it references).

use super::config::{Arch, LayerKind, ModelConfig};
use crate::error::{QkError, Result};
use crate::gguf::{GgmlType, GgufFile, TensorInfo};
use crate::gpu::{Gpu, GpuBuffer, WeightArena, WeightTensor};

/// Beta/alpha logits of a DeltaNet layer.
pub enum BetaAlpha {
    /// One matrix of 2·nv rows written at the beta offset: qwen3next `ssm_ba` (per k-group
    /// [b × r, a × r], docs/numerics.md "Tensors"), or qwen35* beta ‖ alpha stacked at load.
    Grouped(WeightTensor),
    /// qwen35* `ssm_beta`, `ssm_alpha`.
    Split { beta: WeightTensor, alpha: WeightTensor },
}

/// The q‖k‖v and z projections of a DeltaNet layer.
pub enum DeltaNetProjection {
    /// `attn_qkv` (rows q ‖ k ‖ v) and `attn_gate` (z); where their types match, `stacked` is both
    /// in one buffer (q ‖ k ‖ v ‖ z rows; `qkv` and `gate` are views of it), which the decode step
    /// takes in one product.
    Split {
        qkv: WeightTensor,
        gate: WeightTensor,
        stacked: Option<WeightTensor>,
    },
    /// Legacy qwen3next `ssm_in` (HF in_proj_qkvz): per k-head g the rows
    /// [q_g (dk) ‖ k_g (dk) ‖ v of its r v-heads ‖ z of the same] (docs/numerics.md "Tensors").
    Legacy(WeightTensor),
}

pub struct DeltaNetWeights {
    pub proj: DeltaNetProjection,
    pub ba: BetaAlpha,
    /// [channel][tap], tap 0 oldest (GGUF ne {K, C}).
    pub conv: GpuBuffer,
    pub ssm_a: GpuBuffer,
    pub dt_bias: GpuBuffer,
    pub norm: GpuBuffer,
    pub out: WeightTensor,
}

pub enum AttnProjection {
    Separate {
        q: WeightTensor,
        k: WeightTensor,
        v: WeightTensor,
    },
    /// `attn_qkv` in an attention layer: rows [q+gate interleaved per head ‖ K ‖ V].
    Fused(WeightTensor),
}

pub struct AttentionWeights {
    pub proj: AttnProjection,
    pub q_norm: GpuBuffer,
    pub k_norm: GpuBuffer,
    pub out: WeightTensor,
}

pub enum Mixer {
    DeltaNet(Box<DeltaNetWeights>),
    Attention(Box<AttentionWeights>),
}

pub enum ExpertGateUp {
    Separate {
        gate: WeightTensor,
        up: WeightTensor,
    },
    /// `ffn_gate_up_exps`: per expert, gate rows first, then up rows.
    Fused(WeightTensor),
}

/// Matrices over the same input whose outputs are adjacent, stacked into one when their types
/// match.
pub enum Stacked {
    One(WeightTensor),
    Parts(Vec<WeightTensor>),
}

impl Stacked {
    pub fn bytes(&self) -> u64 {
        let b = |w: &WeightTensor| w.rows * w.row_bytes * w.experts;
        match self {
            Stacked::One(w) => b(w),
            Stacked::Parts(p) => p.iter().map(b).sum(),
        }
    }
}

pub struct MoeWeights {
    /// Router rows (experts), then the shared expert's scalar gate row (`ffn_gate_inp_shexp`).
    pub router: Stacked,
    pub gate_up: ExpertGateUp,
    pub down: WeightTensor,
    /// Shared expert gate rows, then up rows.
    pub shared_gate_up: Stacked,
    pub shared_down: WeightTensor,
    /// The shared expert is also expert `experts` (one past the routed ones) of `gate_up` (fused)
    /// and `down`, so the decode step runs it as one more routed pick; false where its types or
    /// widths differ from the routed experts'.
    pub shared_in_experts: bool,
}

pub struct LayerWeights {
    pub index: u32,
    pub attn_norm: GpuBuffer,
    pub post_norm: GpuBuffer,
    pub mixer: Mixer,
    pub moe: MoeWeights,
}

pub struct Weights {
    pub embed: Option<WeightTensor>,
    pub output_norm: Option<GpuBuffer>,
    pub output: Option<WeightTensor>,
    pub layers: Vec<LayerWeights>,
    /// Device bytes held by the weights.
    pub bytes: u64,
}

struct Loader<'a> {
    gpu: &'a Gpu,
    file: &'a GgufFile,
    arena: Option<&'a WeightArena>,
    bytes: u64,
}

impl Loader<'_> {
    fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.file.tensor(name).ok_or_else(|| QkError::Gguf {
            file: self.file.path().display().to_string(),
            msg: format!("tensor {name} missing"),
        })
    }

    fn shape_error(&self, t: &TensorInfo, want: &[u64]) -> QkError {
        QkError::Gguf {
            file: self.file.path().display().to_string(),
            msg: format!("tensor {} has ne {:?}, expected {:?}", t.name, t.ne, want),
        }
    }

    /// `parts` (name, rows) of ne {cols, rows[, experts]} stacked row-wise (per expert for a
    /// stack) into one tensor when they share a type, else each on its own.
    fn stacked(&mut self, parts: &[(&str, u32)], cols: u32, experts: u32) -> Result<Stacked> {
        let mut infos = Vec::new();
        for (name, rows) in parts {
            infos.push(self.checked(name, cols, *rows, experts)?);
        }
        let ty = infos[0].1;
        if infos.iter().any(|(_, t)| *t != ty) {
            let mut out = Vec::new();
            for (name, rows) in parts {
                out.push(self.matrix(name, cols, *rows, experts)?);
            }
            return Ok(Stacked::Parts(out));
        }
        let datas = infos
            .iter()
            .map(|(t, _)| self.file.tensor_data(t))
            .collect::<Result<Vec<_>>>()?;
        let total: usize = datas.iter().map(|d| d.len()).sum();
        let mut joined = Vec::with_capacity(total);
        let ex = experts.max(1) as usize;
        for e in 0..ex {
            for d in &datas {
                let per = d.len() / ex;
                joined.extend_from_slice(&d[e * per..(e + 1) * per]);
            }
        }
        let rows: u32 = parts.iter().map(|(_, r)| r).sum();
        let name = parts.iter().map(|(n, _)| *n).collect::<Vec<_>>().join("+");
        Ok(Stacked::One(
            self.upload(&name, ty, cols, rows, experts, &joined)?,
        ))
    }

    /// The tensor `name` checked to have ne = {cols, rows[, experts]}, and its type.
    /// The routed experts (`parts` stacked per expert, as [`Loader::stacked`]) with the shared
    /// expert (`shared`, dense, stacked the same way) appended as one more expert — or None when a
    /// type or a width differs, so the shared expert cannot pass for a routed one.
    fn experts_with_shared(
        &mut self,
        parts: &[(&str, u32)],
        shared: &[(&str, u32)],
        cols: u32,
        experts: u32,
    ) -> Result<Option<WeightTensor>> {
        let mut infos = Vec::new();
        for (name, rows) in parts {
            infos.push(self.checked(name, cols, *rows, experts)?);
        }
        let mut shared_infos = Vec::new();
        for (name, rows) in shared {
            shared_infos.push(self.checked(name, cols, *rows, 1)?);
        }
        let ty = infos[0].1;
        let rows: u32 = parts.iter().map(|(_, r)| r).sum();
        let shared_rows: u32 = shared.iter().map(|(_, r)| r).sum();
        if infos.iter().chain(&shared_infos).any(|(_, t)| *t != ty) || rows != shared_rows {
            return Ok(None);
        }
        let datas = infos
            .iter()
            .chain(&shared_infos)
            .map(|(t, _)| self.file.tensor_data(t))
            .collect::<Result<Vec<_>>>()?;
        let (routed, shared_datas) = datas.split_at(infos.len());
        let mut joined = Vec::with_capacity(datas.iter().map(|d| d.len()).sum());
        let ex = experts.max(1) as usize;
        for e in 0..ex {
            for d in routed {
                let per = d.len() / ex;
                joined.extend_from_slice(&d[e * per..(e + 1) * per]);
            }
        }
        for d in shared_datas {
            joined.extend_from_slice(d);
        }
        let name = parts
            .iter()
            .chain(shared)
            .map(|(n, _)| *n)
            .collect::<Vec<_>>()
            .join("+");
        Ok(Some(self.upload(&name, ty, cols, rows, experts + 1, &joined)?))
    }

    fn checked(&self, name: &str, cols: u32, rows: u32, experts: u32) -> Result<(&TensorInfo, GgmlType)> {
        let t = self.info(name)?;
        let mut want = vec![u64::from(cols), u64::from(rows)];
        if experts > 1 {
            want.push(u64::from(experts));
        }
        // Trailing unit dimensions are optional ({n_embd} ≡ {n_embd, 1}, docs/numerics.md "Tensors").
        let trim = |v: &[u64]| {
            let mut v = v.to_vec();
            while v.last() == Some(&1) {
                v.pop();
            }
            v
        };
        if trim(&t.ne) != trim(&want) {
            return Err(self.shape_error(t, &want));
        }
        Ok((t, t.ggml_type()?))
    }

    /// A matrix (or expert stack) with ne = {cols, rows[, experts]}.
    fn matrix(&mut self, name: &str, cols: u32, rows: u32, experts: u32) -> Result<WeightTensor> {
        let (t, ty) = self.checked(name, cols, rows, experts)?;
        let data = self.file.tensor_data(t)?;
        self.upload(name, ty, cols, rows, experts, data)
    }

    /// `bytes` (`experts` matrices of `rows` × `cols` of `ty`) uploaded, the small ones into the
    /// loader's arena, and counted.
    fn upload(
        &mut self,
        name: &str,
        ty: GgmlType,
        cols: u32,
        rows: u32,
        experts: u32,
        bytes: &[u8],
    ) -> Result<WeightTensor> {
        let w = self.gpu.upload_weight_windowed(
            name,
            ty,
            u64::from(cols),
            u64::from(rows),
            u64::from(experts),
            bytes,
            u64::MAX,
            self.arena,
        )?;
        self.bytes += bytes.len() as u64;
        Ok(w)
    }

    /// A vector of `len` values (any stored shape with that many elements), as f32.
    fn vector(&mut self, name: &str, len: u32) -> Result<GpuBuffer> {
        let t = self.info(name)?;
        if t.n_elements != u64::from(len) {
            return Err(self.shape_error(t, &[u64::from(len)]));
        }
        t.ggml_type()?;
        let values = self.file.dequantize_tensor(t)?;
        self.bytes += values.len() as u64 * 4;
        self.gpu
            .place(self.arena, name, bytemuck::cast_slice(&values), &[])
    }

    fn layer(&mut self, cfg: &ModelConfig, il: u32) -> Result<LayerWeights> {
        let p = |s: &str| format!("blk.{il}.{s}");
        let e = cfg.n_embd;
        let mixer = match cfg.kinds[il as usize] {
            LayerKind::DeltaNet => {
                let proj = if self.file.tensor(&p("attn_qkv.weight")).is_some() {
                    let (qkv, gate) = (p("attn_qkv.weight"), p("attn_gate.weight"));
                    let parts = [(qkv.as_str(), cfg.conv_dim()), (gate.as_str(), cfg.value_dim())];
                    match self.stacked(&parts, e, 1)? {
                        Stacked::One(both) => match both.split_rows(u64::from(cfg.conv_dim()), [&qkv, &gate])
                        {
                            Some([qkv, gate]) => DeltaNetProjection::Split {
                                qkv,
                                gate,
                                stacked: Some(both),
                            },
                            // The stack spans bindings: each part on its own after all.
                            None => {
                                self.bytes -= both.rows * both.row_bytes;
                                drop(both);
                                DeltaNetProjection::Split {
                                    qkv: self.matrix(&qkv, e, cfg.conv_dim(), 1)?,
                                    gate: self.matrix(&gate, e, cfg.value_dim(), 1)?,
                                    stacked: None,
                                }
                            }
                        },
                        // Types differ: each part on its own.
                        Stacked::Parts(mut v) => {
                            let missing = || QkError::Engine("DeltaNet projection parts".into());
                            let gate = v.pop().ok_or_else(missing)?;
                            let qkv = v.pop().ok_or_else(missing)?;
                            DeltaNetProjection::Split {
                                qkv,
                                gate,
                                stacked: None,
                            }
                        }
                    }
                } else {
                    let rows = cfg.conv_dim() + cfg.value_dim();
                    DeltaNetProjection::Legacy(self.matrix(&p("ssm_in.weight"), e, rows, 1)?)
                };
                let nv = cfg.v_heads;
                let ba = match cfg.arch {
                    Arch::Qwen3Next => BetaAlpha::Grouped(self.matrix(&p("ssm_ba.weight"), e, 2 * nv, 1)?),
                    Arch::Qwen35Moe => {
                        let (b, a) = (p("ssm_beta.weight"), p("ssm_alpha.weight"));
                        match self.stacked(&[(&b, nv), (&a, nv)], e, 1)? {
                            Stacked::One(ba) => BetaAlpha::Grouped(ba),
                            Stacked::Parts(mut v) => {
                                let alpha = v.pop().ok_or_else(|| QkError::Engine("alpha".into()))?;
                                let beta = v.pop().ok_or_else(|| QkError::Engine("beta".into()))?;
                                BetaAlpha::Split { beta, alpha }
                            }
                        }
                    }
                };
                Mixer::DeltaNet(Box::new(DeltaNetWeights {
                    proj,
                    ba,
                    conv: self.vector(&p("ssm_conv1d.weight"), cfg.conv_taps * cfg.conv_dim())?,
                    ssm_a: self.vector(&p("ssm_a"), nv)?,
                    dt_bias: self.vector(&p("ssm_dt.bias"), nv)?,
                    norm: self.vector(&p("ssm_norm.weight"), cfg.dv)?,
                    out: self.matrix(&p("ssm_out.weight"), cfg.value_dim(), e, 1)?,
                }))
            }
            LayerKind::Attention => {
                let hd = cfg.head_dim;
                let q_rows = 2 * cfg.heads * hd;
                let kv_rows = cfg.kv_heads * hd;
                let proj = if self.file.tensor(&p("attn_q.weight")).is_some() {
                    let (q, k, v) = (p("attn_q.weight"), p("attn_k.weight"), p("attn_v.weight"));
                    match self.stacked(&[(&q, q_rows), (&k, kv_rows), (&v, kv_rows)], e, 1)? {
                        Stacked::One(qkv) => AttnProjection::Fused(qkv),
                        Stacked::Parts(mut parts) => {
                            let missing = || QkError::Engine("attention projection parts".into());
                            let v = parts.pop().ok_or_else(missing)?;
                            let k = parts.pop().ok_or_else(missing)?;
                            let q = parts.pop().ok_or_else(missing)?;
                            AttnProjection::Separate { q, k, v }
                        }
                    }
                } else {
                    AttnProjection::Fused(self.matrix(&p("attn_qkv.weight"), e, q_rows + 2 * kv_rows, 1)?)
                };
                Mixer::Attention(Box::new(AttentionWeights {
                    proj,
                    q_norm: self.vector(&p("attn_q_norm.weight"), hd)?,
                    k_norm: self.vector(&p("attn_k_norm.weight"), hd)?,
                    out: self.matrix(&p("attn_output.weight"), cfg.heads * hd, e, 1)?,
                }))
            }
        };
        let (ne, ff) = (cfg.experts, cfg.expert_ff);
        let sff = cfg.shared_ff;
        let (router, shared_gate) = (p("ffn_gate_inp.weight"), p("ffn_gate_inp_shexp.weight"));
        let (sg, su) = (p("ffn_gate_shexp.weight"), p("ffn_up_shexp.weight"));
        let (down, sd) = (p("ffn_down_exps.weight"), p("ffn_down_shexp.weight"));
        let fused = p("ffn_gate_up_exps.weight");
        let (g, u) = (p("ffn_gate_exps.weight"), p("ffn_up_exps.weight"));
        let gate_up_parts: Vec<(&str, u32)> = if self.file.tensor(&fused).is_some() {
            vec![(&fused, 2 * ff)]
        } else {
            vec![(&g, ff), (&u, ff)]
        };
        let shared_gate_up = [(sg.as_str(), sff), (su.as_str(), sff)];
        // The shared expert rides along as expert `ne` where it can (the decode step's fast path).
        let with_shared = match self.experts_with_shared(&gate_up_parts, &shared_gate_up, e, ne)? {
            Some(gu) => self
                .experts_with_shared(&[(&down, e)], &[(&sd, e)], ff, ne)?
                .map(|d| (gu, d)),
            None => None,
        };
        let shared_in_experts = with_shared.is_some();
        let (gate_up, down) = match with_shared {
            Some((gu, d)) => (ExpertGateUp::Fused(gu), d),
            None => {
                let gate_up = match self.stacked(&gate_up_parts, e, ne)? {
                    Stacked::One(gu) => ExpertGateUp::Fused(gu),
                    Stacked::Parts(mut v) => {
                        let up = v.pop().ok_or_else(|| QkError::Engine("up experts".into()))?;
                        let gate = v.pop().ok_or_else(|| QkError::Engine("gate experts".into()))?;
                        ExpertGateUp::Separate { gate, up }
                    }
                };
                (gate_up, self.matrix(&down, ff, e, ne)?)
            }
        };
        let moe = MoeWeights {
            router: self.stacked(&[(&router, ne), (&shared_gate, 1)], e, 1)?,
            gate_up,
            down,
            shared_gate_up: self.stacked(&shared_gate_up, e, 1)?,
            shared_down: self.matrix(&sd, sff, e, 1)?,
            shared_in_experts,
        };
        Ok(LayerWeights {
            index: il,
            attn_norm: self.vector(&p("attn_norm.weight"), e)?,
            post_norm: self.vector(&p("post_attention_norm.weight"), e)?,
            mixer,
            moe,
        })
    }
}

impl Weights {
    /// Every tensor of layers [a, b) (and every global tensor) must have a type qk reads; the error
    /// names the tensor and its type. Checked before any device work so a bad file fails fast.
    pub fn check_types(file: &GgufFile, layers: (u32, u32)) -> Result<()> {
        let (a, b) = layers;
        for t in file.tensors() {
            let in_range = match t.name.strip_prefix("blk.") {
                Some(rest) => rest
                    .split('.')
                    .next()
                    .and_then(|n| n.parse::<u32>().ok())
                    .is_some_and(|il| il >= a && il < b),
                None => true,
            };
            if in_range {
                t.ggml_type()?;
            }
        }
        Ok(())
    }

    /// Upload layers [a, b) and the global tensors the range needs, the small ones packed into
    /// arena buffers when `packed`; `progress` gets a line per step.
    pub fn load(
        gpu: &Gpu,
        file: &GgufFile,
        cfg: &ModelConfig,
        layers: (u32, u32),
        packed: bool,
        progress: &mut dyn FnMut(&str),
    ) -> Result<Weights> {
        let (a, b) = layers;
        // The shapes below are products of hyper-parameters in u32: bounded by the config's check
        // (again here, for a config not read by ModelConfig::from_gguf).
        cfg.check()
            .map_err(|msg| QkError::gguf(file.path().display().to_string(), msg))?;
        crate::ensure!(
            a < b && b <= cfg.n_layer,
            QkError::Engine(format!(
                "layers [{a}, {b}) outside the model's {} main layers",
                cfg.n_layer
            ))
        );
        Self::check_types(file, layers)?;
        let arena = packed.then(WeightArena::new);
        let mut ld = Loader {
            gpu,
            file,
            arena: arena.as_ref(),
            bytes: 0,
        };
        let has_output = file.tensor("output.weight").is_some();
        let embed = if a == 0 || (b == cfg.n_layer && !has_output) {
            progress("token_embd");
            Some(ld.matrix("token_embd.weight", cfg.n_embd, cfg.vocab, 1)?)
        } else {
            None
        };
        let mut out_layers = Vec::new();
        for il in a..b {
            progress(&format!("layer {il} ({:?})", cfg.kinds[il as usize]));
            out_layers.push(ld.layer(cfg, il)?);
        }
        let (output_norm, output) = if b == cfg.n_layer {
            progress("output");
            let norm = ld.vector("output_norm.weight", cfg.n_embd)?;
            let head = if has_output {
                ld.matrix("output.weight", cfg.n_embd, cfg.vocab, 1)?
            } else {
                embed
                    .clone()
                    .ok_or_else(|| QkError::Engine("no output.weight and no token_embd".into()))?
            };
            (Some(norm), Some(head))
        } else {
            (None, None)
        };
        let embed = if a == 0 { embed } else { None };
        // The arena's buffers whole, for the tensors in them.
        let bytes = ld.bytes + arena.as_ref().map_or(0, WeightArena::overhead);
        Ok(Weights {
            embed,
            output_norm,
            output,
            layers: out_layers,
            bytes,
        })
    }
}
