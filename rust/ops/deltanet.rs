//! Gated DeltaNet (shaders/deltanet.wgsl): the recurrent step and the chunked (chunk 64, WY/UT)
//! prefill, the plan that splits a prefill call at absolute multiples of 64, and CPU references of
//! both forms.
//!
//! A call for positions [base, base + n): positions before the next multiple of 64 run the
//! recurrent form, the rest run the chunked form in chunks starting on multiples of 64 (the last
//! one possibly partial). A call cut at a multiple of 64 therefore computes exactly the same chunks
//! as one long call (byte-identical); a call starting mid-chunk agrees with it to rounding.

use super::elementwise::require_len;
use crate::gpu::{Gpu, GpuBuffer, Recorder, ShaderFile};

pub const FILE: ShaderFile = crate::shader_file!("deltanet", DeltaParams);
/// Chunk length of the chunked form (docs/numerics.md "Chunked DeltaNet").
pub const CHUNK: u32 = 64;
/// Value columns per workgroup of the recurrent and chunk-state entry points.
pub const COLUMNS_PER_WORKGROUP: u32 = 16;
/// W and U columns per workgroup of the chunked form's `wu` entry point.
const WU_COLUMNS: u32 = 64;
/// Largest key head dim the shader's register and workgroup arrays hold.
pub const MAX_DK: u32 = 128;

/// How a v-head finds its q/k head (docs/numerics.md "Head pairing").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadPairing {
    /// qwen3next: k-head = n / (nv / nk).
    Grouped = 0,
    /// qwen35 / qwen35moe: k-head = n mod nk.
    Tiled = 1,
}

impl HeadPairing {
    pub fn k_head(self, n: u32, k_heads: u32, v_heads: u32) -> u32 {
        match self {
            HeadPairing::Grouped => n / (v_heads / k_heads),
            HeadPairing::Tiled => n % k_heads,
        }
    }
}

crate::gpu_params! {
    /// The immediates of deltanet.wgsl.
    pub struct DeltaParams {
        pub tokens: u32,
        pub k_heads: u32,
        pub v_heads: u32,
        pub dk: u32,
        pub dv: u32,
        /// 0: k-head of v-head n is n / (v_heads / k_heads) (qwen3next); 1: n % k_heads (qwen35*).
        pub pairing: u32,
        pub first_token: u32,
        pub chunks: u32,
        pub qkv_token_stride: u32,
        pub q_offset: u32,
        pub k_offset: u32,
        pub v_offset: u32,
        /// beta logit of v-head n at ba_token_stride*t + beta_offset + (n / ba_group)*ba_group_stride
        /// + n % ba_group; alpha logits likewise at alpha_offset (qwen3next groups them per k-head).
        pub ba_token_stride: u32,
        pub ba_group: u32,
        pub ba_group_stride: u32,
        pub beta_offset: u32,
        pub alpha_offset: u32,
        pub out_offset: u32,
        pub out_token_stride: u32,
        pub state_offset: u32,
        pub eps: f32,
        pub q_scale: f32,
        pub _pad0: u32,
        pub _pad1: u32,
    }
}

impl DeltaParams {
    /// f32 count of the chunked form's scratch for `tokens` tokens.
    pub fn scratch_len(&self, tokens: u32) -> u64 {
        let chunks = tokens.div_ceil(CHUNK) as u64;
        chunks * self.v_heads as u64 * (CHUNK * (self.dk + self.dv + 2 * CHUNK + 5)) as u64
    }

    pub fn validate(&self) -> crate::Result<()> {
        use crate::QkError;
        crate::ensure!(
            self.k_heads > 0 && self.v_heads.is_multiple_of(self.k_heads),
            QkError::Engine(format!(
                "deltanet: {} v-heads over {} k-heads",
                self.v_heads, self.k_heads
            ))
        );
        crate::ensure!(
            self.dk > 0 && self.dk <= MAX_DK && self.dv > 0 && self.ba_group > 0,
            QkError::Engine(format!("deltanet: dk {} (max {MAX_DK}), dv {}", self.dk, self.dv))
        );
        Ok(())
    }
}

/// How one prefill call for positions [base, base + tokens) is split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillPlan {
    /// Tokens (from the call's first) run by the recurrent form: up to the next multiple of 64.
    pub recurrent_tokens: u32,
    /// Tokens after those, run by the chunked form.
    pub chunked_tokens: u32,
}

impl PrefillPlan {
    pub fn new(base: u32, tokens: u32) -> Self {
        let to_boundary = (CHUNK - base % CHUNK) % CHUNK;
        let recurrent_tokens = to_boundary.min(tokens);
        PrefillPlan {
            recurrent_tokens,
            chunked_tokens: tokens - recurrent_tokens,
        }
    }

    pub fn chunks(&self) -> u32 {
        self.chunked_tokens.div_ceil(CHUNK)
    }
}

/// The operands of the DeltaNet kernels. `qkv` is the conv output ([q | k | v] per token), `ba`
/// the beta/alpha logits, `state` the per-v-head states (layout in the shader), `out` the output
/// rows; `scratch` (the chunked form only) holds [`DeltaParams::scratch_len`] floats.
pub struct DeltaArgs<'a> {
    pub qkv: &'a GpuBuffer,
    pub ba: &'a GpuBuffer,
    pub ssm_a: &'a GpuBuffer,
    pub dt_bias: &'a GpuBuffer,
    pub state: &'a GpuBuffer,
    pub out: &'a GpuBuffer,
    pub scratch: Option<&'a GpuBuffer>,
}

fn check(p: &DeltaParams, args: &DeltaArgs<'_>) -> crate::Result<()> {
    p.validate()?;
    let end = p.first_token as u64 + p.tokens as u64;
    if end > 0 {
        let last = end - 1;
        require_len(
            "deltanet qkv",
            args.qkv,
            last * p.qkv_token_stride as u64 + p.v_offset as u64 + (p.v_heads * p.dv) as u64,
        )?;
        require_len("deltanet ba", args.ba, (last + 1) * p.ba_token_stride as u64)?;
        require_len(
            "deltanet out",
            args.out,
            p.out_offset as u64 + last * p.out_token_stride as u64 + (p.v_heads * p.dv) as u64,
        )?;
    }
    require_len("deltanet ssm_a", args.ssm_a, p.v_heads as u64)?;
    require_len("deltanet dt_bias", args.dt_bias, p.v_heads as u64)?;
    require_len(
        "deltanet state",
        args.state,
        p.state_offset as u64 + (p.v_heads * p.dk * p.dv) as u64,
    )
}

/// Record the recurrent form for tokens `p.first_token .. p.first_token + p.tokens`.
pub fn record_recurrent(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    p: &DeltaParams,
    args: &DeltaArgs<'_>,
) -> crate::Result<()> {
    check(p, args)?;
    let pipe = gpu.pipeline(&FILE, &[("OP", "recurrent".into())], &[])?;
    rec.dispatch(
        &pipe,
        &[
            args.qkv.all(),
            args.ba.all(),
            args.ssm_a.all(),
            args.dt_bias.all(),
            args.state.all(),
            args.out.all(),
        ],
        bytemuck::bytes_of(p),
        [p.dv.div_ceil(COLUMNS_PER_WORKGROUP), p.v_heads, 1],
    )
}

/// How the chunked form's state pass reads the W, q, P and k rows (the same bytes either way).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateLoads {
    Scalar,
    /// As vec4 through a second view of the read-only buffers (k too, 4 key rows at a time), where
    /// the rows are 16-byte aligned (dk a multiple of 16, the qkv token stride and the q and k
    /// offsets multiples of 4); Scalar elsewhere.
    Vec4,
}

/// What the engine's state pass uses: Vec4 took 197 µs for Scalar's 282 per layer of 512 tokens on
/// the H200 (benches/RESULTS.md, 2026-12-02).
pub const STATE_LOADS: StateLoads = StateLoads::Vec4;

/// Record the chunked form for tokens `p.first_token ..` (`p.tokens` of them, the first on an
/// absolute multiple of 64): the prep pass over all chunks, W and U, then the state pass.
pub fn record_chunked(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    p: &DeltaParams,
    args: &DeltaArgs<'_>,
) -> crate::Result<()> {
    record_chunked_with(gpu, rec, p, args, STATE_LOADS)
}

/// [`record_chunked`] with the state pass's loads chosen.
pub fn record_chunked_with(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    p: &DeltaParams,
    args: &DeltaArgs<'_>,
    loads: StateLoads,
) -> crate::Result<()> {
    check(p, args)?;
    let mut p = *p;
    p.chunks = p.tokens.div_ceil(CHUNK);
    if p.chunks == 0 {
        return Ok(());
    }
    let scratch = args
        .scratch
        .ok_or_else(|| crate::QkError::Engine("deltanet chunked form needs a scratch buffer".into()))?;
    require_len("deltanet scratch", scratch, p.scratch_len(p.tokens))?;
    let prep = gpu.pipeline(&FILE, &[("OP", "prep".into())], &[])?;
    rec.dispatch(
        &prep,
        &[
            args.qkv.all(),
            args.ba.all(),
            args.ssm_a.all(),
            args.dt_bias.all(),
            scratch.all(),
        ],
        bytemuck::bytes_of(&p),
        [p.chunks, p.v_heads, 1],
    )?;
    let wu = gpu.pipeline(&FILE, &[("OP", "wu".into())], &[])?;
    rec.dispatch(
        &wu,
        &[args.qkv.all(), scratch.all()],
        bytemuck::bytes_of(&p),
        [
            p.chunks,
            p.v_heads,
            p.dk.div_ceil(WU_COLUMNS) + p.dv.div_ceil(WU_COLUMNS),
        ],
    )?;
    let aligned = p.dk.is_multiple_of(16)
        && [p.qkv_token_stride, p.q_offset, p.k_offset]
            .iter()
            .all(|v| v.is_multiple_of(4));
    let vec4 = loads == StateLoads::Vec4 && aligned;
    let state = gpu.pipeline(
        &FILE,
        &[("OP", "state".into()), ("VEC4", u32::from(vec4).to_string())],
        &[],
    )?;
    let mut bindings = vec![args.qkv.all(), scratch.all(), args.state.all(), args.out.all()];
    if vec4 {
        bindings.extend([args.qkv.all(), scratch.all()]);
    }
    rec.dispatch(
        &state,
        &bindings,
        bytemuck::bytes_of(&p),
        [p.dv.div_ceil(COLUMNS_PER_WORKGROUP), p.v_heads, 1],
    )
}

/// Record a prefill call for absolute positions `base .. base + p.tokens` (tokens 0.. of the
/// buffers): recurrent up to the next multiple of 64, chunked after it ([`PrefillPlan`]).
pub fn record_prefill(
    gpu: &Gpu,
    rec: &mut Recorder<'_>,
    p: &DeltaParams,
    base: u32,
    args: &DeltaArgs<'_>,
) -> crate::Result<()> {
    let plan = PrefillPlan::new(base, p.tokens);
    if plan.recurrent_tokens > 0 {
        let head = DeltaParams {
            tokens: plan.recurrent_tokens,
            first_token: p.first_token,
            ..*p
        };
        record_recurrent(gpu, rec, &head, args)?;
    }
    if plan.chunked_tokens > 0 {
        let rest = DeltaParams {
            tokens: plan.chunked_tokens,
            first_token: p.first_token + plan.recurrent_tokens,
            ..*p
        };
        record_chunked(gpu, rec, &rest, args)?;
    }
    Ok(())
}

pub mod reference {
    //! f64 references over the same buffer layouts as the shader.
    use super::DeltaParams;

    struct Token {
        q: Vec<f64>,
        k: Vec<f64>,
        v: Vec<f64>,
        g: f64,
        beta: f64,
    }

    fn l2(x: &[f32], eps: f64, scale: f64) -> Vec<f64> {
        let norm = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
        x.iter().map(|v| *v as f64 * scale / norm.max(eps)).collect()
    }

    fn token(
        p: &DeltaParams,
        qkv: &[f32],
        ba: &[f32],
        ssm_a: &[f32],
        dt_bias: &[f32],
        t: usize,
        n: usize,
    ) -> Token {
        let (dk, dv) = (p.dk as usize, p.dv as usize);
        let kh = if p.pairing == 0 {
            n / (p.v_heads / p.k_heads) as usize
        } else {
            n % p.k_heads as usize
        };
        let row = t * p.qkv_token_stride as usize;
        let q = &qkv[row + p.q_offset as usize + kh * dk..][..dk];
        let k = &qkv[row + p.k_offset as usize + kh * dk..][..dk];
        let v = &qkv[row + p.v_offset as usize + n * dv..][..dv];
        let ba_at = |off: u32| {
            ba[t * p.ba_token_stride as usize
                + off as usize
                + (n / p.ba_group as usize) * p.ba_group_stride as usize
                + n % p.ba_group as usize] as f64
        };
        let x = ba_at(p.alpha_offset) + dt_bias[n] as f64;
        let softplus = if x > 20.0 { x } else { x.exp().ln_1p() };
        Token {
            q: l2(q, p.eps as f64, p.q_scale as f64),
            k: l2(k, p.eps as f64, 1.0),
            v: v.iter().map(|x| *x as f64).collect(),
            g: ssm_a[n] as f64 * softplus,
            beta: 1.0 / (1.0 + (-ba_at(p.beta_offset)).exp()),
        }
    }

    /// Token-by-token delta rule (docs/numerics.md "Gated DeltaNet" step 7) for tokens first_token..first_token+tokens;
    /// `state` in the shader layout (value-major), updated in place.
    #[allow(clippy::too_many_arguments)]
    pub fn recurrent(
        p: &DeltaParams,
        qkv: &[f32],
        ba: &[f32],
        ssm_a: &[f32],
        dt_bias: &[f32],
        state: &mut [f32],
        out: &mut [f32],
    ) {
        let (dk, dv) = (p.dk as usize, p.dv as usize);
        for n in 0..p.v_heads as usize {
            let sb = p.state_offset as usize + n * dv * dk;
            let mut s: Vec<f64> = state[sb..sb + dk * dv].iter().map(|x| *x as f64).collect();
            for step in 0..p.tokens as usize {
                let t = p.first_token as usize + step;
                let tok = token(p, qkv, ba, ssm_a, dt_bias, t, n);
                let decay = tok.g.exp();
                for j in 0..dv {
                    let col = &mut s[j * dk..(j + 1) * dk];
                    col.iter_mut().for_each(|x| *x *= decay);
                    let kv: f64 = (0..dk).map(|i| col[i] * tok.k[i]).sum();
                    let delta = tok.beta * (tok.v[j] - kv);
                    (0..dk).for_each(|i| col[i] += tok.k[i] * delta);
                    let o: f64 = (0..dk).map(|i| col[i] * tok.q[i]).sum();
                    out[p.out_offset as usize + t * p.out_token_stride as usize + n * dv + j] = o as f32;
                }
            }
            for (dst, src) in state[sb..sb + dk * dv].iter_mut().zip(&s) {
                *dst = *src as f32;
            }
        }
    }

    // Index loops read like the matrix formulas of docs/numerics.md, which is the point of a reference.
    #[allow(clippy::needless_range_loop)]
    /// The chunked WY/UT form (docs/numerics.md "Chunked DeltaNet") with chunks of `chunk` tokens starting at first_token,
    /// written independently of the shader as a second derivation of the same numbers.
    #[allow(clippy::too_many_arguments)]
    pub fn chunked(
        p: &DeltaParams,
        chunk: usize,
        qkv: &[f32],
        ba: &[f32],
        ssm_a: &[f32],
        dt_bias: &[f32],
        state: &mut [f32],
        out: &mut [f32],
    ) {
        let (dk, dv) = (p.dk as usize, p.dv as usize);
        for n in 0..p.v_heads as usize {
            let sb = p.state_offset as usize + n * dv * dk;
            // s[i][j] (key-major here, for readability)
            let mut s = vec![vec![0.0f64; dv]; dk];
            for j in 0..dv {
                for i in 0..dk {
                    s[i][j] = state[sb + j * dk + i] as f64;
                }
            }
            let mut start = 0usize;
            while start < p.tokens as usize {
                let len = chunk.min(p.tokens as usize - start);
                let toks: Vec<Token> = (0..len)
                    .map(|r| token(p, qkv, ba, ssm_a, dt_bias, p.first_token as usize + start + r, n))
                    .collect();
                let mut gamma = vec![0.0f64; len];
                let mut acc = 0.0;
                for r in 0..len {
                    acc += toks[r].g;
                    gamma[r] = acc;
                }
                let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
                // T = (I + A)^-1 by forward substitution on the full matrix.
                let mut a = vec![vec![0.0f64; len]; len];
                for i in 0..len {
                    for j in 0..i {
                        a[i][j] = toks[i].beta * dot(&toks[i].k, &toks[j].k) * (gamma[i] - gamma[j]).exp();
                    }
                }
                let mut tm = vec![vec![0.0f64; len]; len];
                for i in 0..len {
                    tm[i][i] = 1.0;
                    for j in 0..i {
                        tm[i][j] = -(j..i).map(|m| a[i][m] * tm[m][j]).sum::<f64>();
                    }
                }
                let w: Vec<Vec<f64>> = (0..len)
                    .map(|i| {
                        (0..dk)
                            .map(|c| {
                                (0..=i)
                                    .map(|r| tm[i][r] * toks[r].beta * gamma[r].exp() * toks[r].k[c])
                                    .sum()
                            })
                            .collect()
                    })
                    .collect();
                let u: Vec<Vec<f64>> = (0..len)
                    .map(|i| {
                        (0..dv)
                            .map(|c| (0..=i).map(|r| tm[i][r] * toks[r].beta * toks[r].v[c]).sum())
                            .collect()
                    })
                    .collect();
                let vp: Vec<Vec<f64>> = (0..len)
                    .map(|i| {
                        (0..dv)
                            .map(|j| u[i][j] - (0..dk).map(|c| w[i][c] * s[c][j]).sum::<f64>())
                            .collect()
                    })
                    .collect();
                for i in 0..len {
                    let t = p.first_token as usize + start + i;
                    for j in 0..dv {
                        let inter: f64 =
                            gamma[i].exp() * (0..dk).map(|c| toks[i].q[c] * s[c][j]).sum::<f64>();
                        let intra: f64 = (0..=i)
                            .map(|r| dot(&toks[i].q, &toks[r].k) * (gamma[i] - gamma[r]).exp() * vp[r][j])
                            .sum();
                        out[p.out_offset as usize + t * p.out_token_stride as usize + n * dv + j] =
                            (inter + intra) as f32;
                    }
                }
                let gl = gamma[len - 1];
                for (c, row) in s.iter_mut().enumerate() {
                    for (j, x) in row.iter_mut().enumerate() {
                        *x = gl.exp() * *x
                            + (0..len)
                                .map(|r| toks[r].k[c] * (gl - gamma[r]).exp() * vp[r][j])
                                .sum::<f64>();
                    }
                }
                start += len;
            }
            for j in 0..dv {
                for i in 0..dk {
                    state[sb + j * dk + i] = s[i][j] as f32;
                }
            }
        }
    }
}
