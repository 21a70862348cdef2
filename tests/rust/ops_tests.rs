//! Kernel tests: every shader of rust/ops parses and validates with naga; CPU references agree
//! with each other where two derivations exist; GPU kernels match their CPU references.

use qk::ops::{attention, conv, deltanet, elementwise, norm, rope, router, topk};

const SHADERS: &[(&str, &str)] = &[
    (norm::SHADER_NAME, norm::SHADER_SOURCE),
    (rope::SHADER_NAME, rope::SHADER_SOURCE),
    (attention::SHADER_NAME, attention::SHADER_SOURCE),
    (conv::SHADER_NAME, conv::SHADER_SOURCE),
    (deltanet::SHADER_NAME, deltanet::SHADER_SOURCE),
    (router::SHADER_NAME, router::SHADER_SOURCE),
    (topk::SHADER_NAME, topk::SHADER_SOURCE),
    (elementwise::SHADER_NAME, elementwise::SHADER_SOURCE),
];

#[test]
fn ops_shaders_validate_with_naga() {
    for (name, source) in SHADERS {
        let module = naga::front::wgsl::parse_str(source)
            .unwrap_or_else(|e| panic!("{name}.wgsl: {}", e.emit_to_string(source)));
        naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .unwrap_or_else(|e| panic!("{name}.wgsl: {}", e.emit_to_string(source)));
    }
}

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
        DeltaCase {
            params,
            qkv: rng.vec((tokens * stride) as usize, 1.0),
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
