//! Model hyper-parameters read from GGUF metadata (docs/numerics.md "Metadata") and the layer plan: which of
//! the main layers are Gated DeltaNet and which full attention; MTP blocks after the main stack are
//! counted and skipped.

use crate::error::{QkError, Result};
use crate::gguf::GgufFile;

/// The architectures qk runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Qwen3-Next: NeoX RoPE, beta/alpha from `ssm_ba` grouped per k-head, consecutive head pairing.
    Qwen3Next,
    /// Qwen3.5/3.6 MoE: IMRoPE (≡ NeoX for text), `ssm_beta`/`ssm_alpha`, tiled head pairing.
    Qwen35Moe,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Qwen3Next => "qwen3next",
            Arch::Qwen35Moe => "qwen35moe",
        }
    }
}

/// The mixer of one main layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    DeltaNet,
    Attention,
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub arch: Arch,
    /// Main layers (block_count − nextn_predict_layers); MTP blocks are not run.
    pub n_layer: u32,
    /// MTP / NextN blocks stored after the main stack (skipped at load).
    pub n_mtp: u32,
    pub n_embd: u32,
    pub vocab: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub n_rot: u32,
    pub rope_base: f64,
    pub attn_scale: f32,
    pub eps: f32,
    pub experts: u32,
    pub experts_used: u32,
    pub expert_ff: u32,
    pub shared_ff: u32,
    pub conv_taps: u32,
    /// DeltaNet key heads (nk), value heads (nv), key/value head dims (dk = dv).
    pub k_heads: u32,
    pub v_heads: u32,
    pub dk: u32,
    pub dv: u32,
    pub kinds: Vec<LayerKind>,
}

impl ModelConfig {
    pub fn from_gguf(file: &GgufFile) -> Result<ModelConfig> {
        let path = file.path().display().to_string();
        let bad = |msg: String| QkError::Gguf {
            file: path.clone(),
            msg,
        };
        let arch_name = file
            .arch()
            .ok_or_else(|| bad("general.architecture missing".into()))?
            .to_string();
        let arch = match arch_name.as_str() {
            "qwen3next" => Arch::Qwen3Next,
            "qwen35moe" => Arch::Qwen35Moe,
            other => {
                return Err(bad(format!(
                    "architecture {other:?} is not supported (qwen3next, qwen35moe)"
                )));
            }
        };
        let key = |k: &str| format!("{arch_name}.{k}");
        let req = |k: &str| -> Result<u32> {
            file.get_u32(&key(k))
                .ok_or_else(|| bad(format!("{} missing or not an unsigned integer", key(k))))
        };
        let block_count = req("block_count")?;
        let n_mtp = file.get_u32(&key("nextn_predict_layers")).unwrap_or(0);
        if n_mtp >= block_count {
            return Err(bad(format!(
                "nextn_predict_layers {n_mtp} leaves no main layers of {block_count}"
            )));
        }
        let n_layer = block_count - n_mtp;
        let n_embd = req("embedding_length")?;
        let heads = req("attention.head_count")?;
        let kv_heads = req("attention.head_count_kv")?;
        // hd must be read: n_embd / heads differs from it in the real models (docs/numerics.md "Metadata").
        let head_dim = req("attention.key_length")?;
        let n_rot = req("rope.dimension_count")?;
        let rope_base = file
            .get(&key("rope.freq_base"))
            .and_then(|v| v.as_f64())
            .ok_or_else(|| bad(format!("{} missing", key("rope.freq_base"))))?;
        let eps = file
            .get_f32(&key("attention.layer_norm_rms_epsilon"))
            .ok_or_else(|| bad(format!("{} missing", key("attention.layer_norm_rms_epsilon"))))?;
        let attn_scale = file
            .get_f32(&key("attention.scale"))
            .unwrap_or(1.0 / (head_dim as f32).sqrt());
        let interval = file.get_u32(&key("full_attention_interval")).unwrap_or(4);
        let recurrent = file.get_arr_bool(&key("attention.recurrent_layers"));
        let kinds = (0..n_layer)
            .map(|i| {
                let is_recurrent = match recurrent {
                    Some(flags) => flags.get(i as usize).copied().unwrap_or(false),
                    None => interval == 0 || (i + 1) % interval != 0,
                };
                if is_recurrent {
                    LayerKind::DeltaNet
                } else {
                    LayerKind::Attention
                }
            })
            .collect();
        let vocab = match file
            .tensor("token_embd.weight")
            .or_else(|| file.tensor("output.weight"))
        {
            Some(t) => t.ne.get(1).copied().unwrap_or(0) as u32,
            None => file
                .get_arr_str("tokenizer.ggml.tokens")
                .map(|t| t.len() as u32)
                .ok_or_else(|| bad("no token_embd, output or vocabulary to size the vocab".into()))?,
        };
        let dk = req("ssm.state_size")?;
        let v_heads = req("ssm.time_step_rank")?;
        let inner = req("ssm.inner_size")?;
        let cfg = ModelConfig {
            arch,
            n_layer,
            n_mtp,
            n_embd,
            vocab,
            heads,
            kv_heads,
            head_dim,
            n_rot,
            rope_base,
            attn_scale,
            eps,
            experts: req("expert_count")?,
            experts_used: req("expert_used_count")?,
            expert_ff: req("expert_feed_forward_length")?,
            shared_ff: req("expert_shared_feed_forward_length")?,
            conv_taps: req("ssm.conv_kernel")?,
            k_heads: req("ssm.group_count")?,
            v_heads,
            dk,
            dv: inner.checked_div(v_heads).unwrap_or(0),
            kinds,
        };
        cfg.check().map_err(bad)?;
        Ok(cfg)
    }

    fn check(&self) -> std::result::Result<(), String> {
        let nonzero = [
            ("embedding_length", self.n_embd),
            ("head_count", self.heads),
            ("head_count_kv", self.kv_heads),
            ("key_length", self.head_dim),
            ("expert_count", self.experts),
            ("expert_used_count", self.experts_used),
            ("ssm.group_count", self.k_heads),
            ("ssm.time_step_rank", self.v_heads),
            ("ssm.state_size", self.dk),
            ("vocab", self.vocab),
        ];
        for (what, v) in nonzero {
            if v == 0 {
                return Err(format!("{what} is 0"));
            }
        }
        if self.dk != self.dv {
            return Err(format!(
                "ssm state_size {} ≠ value head dim {} (llama.cpp asserts equality)",
                self.dk, self.dv
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads) || !self.v_heads.is_multiple_of(self.k_heads) {
            return Err("head counts do not divide".into());
        }
        if self.experts_used > self.experts {
            return Err(format!("{} experts used of {}", self.experts_used, self.experts));
        }
        if self.n_rot > self.head_dim || !self.n_rot.is_multiple_of(2) {
            return Err(format!(
                "rope dimension {} does not fit head dim {}",
                self.n_rot, self.head_dim
            ));
        }
        Ok(())
    }

    /// DeltaNet q‖k‖v channels (the conv width).
    pub fn conv_dim(&self) -> u32 {
        2 * self.k_heads * self.dk + self.v_heads * self.dv
    }

    pub fn value_dim(&self) -> u32 {
        self.v_heads * self.dv
    }

    /// K (or V) values per cached position of one attention layer.
    pub fn kv_row(&self) -> u32 {
        self.kv_heads * self.head_dim
    }
}
