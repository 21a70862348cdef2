"""NumPy float64 reference of the qwen3next / qwen35moe forward pass (docs/numerics.md "Forward pass"), reading weights
with gguf-py. A test oracle only: clarity over speed; every step follows the spec's numbered lists."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

CHUNK = 64  # chunked-DeltaNet chunk size; boundaries sit at absolute multiples of it (docs/numerics.md "Chunk alignment")


# ---------------------------------------------------------------------------------------------------
# Elementwise pieces


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis; GGUF norm weights already contain the +1 (docs/numerics.md "Tensors")."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """x·(Σx² + eps)^(−1/2) over the last axis: what llama.cpp 0.3.36 computes (rms_norm with eps/n,
    scaled by 1/√n) and what HF/FLA compute."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """x rounded the way ggml-cpu packs activations into Q8_0 (blocks of 32 along the last axis): scale
    d = amax/127 stored as fp16, values round(x·127/amax) half-to-even, all in f32 arithmetic."""
    xb = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    amax = np.max(np.abs(xb), axis=-1, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv)
    return (q.astype(np.float64) * d).reshape(x.shape)


def quantize_q8_k(x: np.ndarray) -> np.ndarray:
    """x rounded the way ggml packs activations into Q8_K (blocks of 256): iscale = −127/max (max = the
    signed value of largest magnitude), q = min(127, rint(iscale·x)), d = 1/iscale, in f32 arithmetic."""
    xb = x.astype(np.float32).reshape(*x.shape[:-1], -1, 256)
    idx = np.argmax(np.abs(xb), axis=-1)[..., None]
    mx = np.take_along_axis(xb, idx, axis=-1)
    with np.errstate(divide="ignore"):
        iscale = np.where(mx != 0, np.float32(-127) / mx, np.float32(0)).astype(np.float32)
        d = np.where(iscale != 0, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
    q = np.minimum(np.rint((xb * iscale).astype(np.float32)), 127)
    return (q.astype(np.float64) * d).reshape(x.shape)


# How llama.cpp's CPU backend rounds the activation operand of a matmul with a weight of each type
# (ggml-cpu type_traits vec_dot_type): F32 weights keep f32 activations; quantised weights meet
# Q8_0 or Q8_K activations (Q4_1/Q5_1 use Q8_1, whose values round like Q8_0).
_Q8_0_PARTNERS = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"}
_Q8_K_PARTNERS = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS"}


def activation_rounding(weight_type: str):
    if weight_type == "F32":
        return None
    if weight_type == "F16":
        return lambda x: x.astype(np.float16).astype(np.float64)
    if weight_type in _Q8_0_PARTNERS:
        return quantize_q8_0
    if weight_type in _Q8_K_PARTNERS:
        return quantize_q8_k
    raise NotImplementedError(f"activation rounding for {weight_type} weights")


# ---------------------------------------------------------------------------------------------------
# Gated delta rule (docs/numerics.md "Chunked DeltaNet"). q, k: (n, H, dk) already paired to v-heads, L2-normed,
# q scaled; v: (n, H, dv); beta, g: (n, H); S: (H, dk, dv) in HF layout (key index first).


def delta_rule_recurrent(q, k, v, beta, g, S):
    """Token-by-token recurrence; returns (o (n, H, dv), final S)."""
    S = S.copy()
    o = np.empty(v.shape)
    for t in range(q.shape[0]):
        S *= np.exp(g[t])[:, None, None]
        kv = np.einsum("hkv,hk->hv", S, k[t])
        delta = beta[t][:, None] * (v[t] - kv)
        S += k[t][:, :, None] * delta[:, None, :]
        o[t] = np.einsum("hkv,hk->hv", S, q[t])
    return o, S


def _chunk(q, k, v, beta, g, S):
    """One chunk of the WY/UT form (docs/numerics.md "Chunked DeltaNet") for every head; rows 0..L−1 of the chunk."""
    L = q.shape[0]
    gamma = np.cumsum(g, axis=0)  # (L, H)
    diff = gamma[:, None, :] - gamma[None, :, :]  # (i, j, H) = γ_i − γ_j
    lower = np.tril(np.ones((L, L), dtype=bool), -1)[:, :, None]
    causal = np.tril(np.ones((L, L), dtype=bool))[:, :, None]
    decay_strict = np.exp(np.where(lower, diff, -np.inf))  # masked before exp: no inf·0
    decay_causal = np.exp(np.where(causal, diff, -np.inf))
    kk = np.einsum("ihd,jhd->ijh", k, k)
    A = beta[:, None, :] * kk * decay_strict
    o = np.empty(v.shape)
    S_next = np.empty(S.shape)
    eye = np.eye(L)
    for h in range(q.shape[1]):
        T = np.linalg.solve(eye + A[:, :, h], eye)  # (I + A)⁻¹, unit lower-triangular
        W = T @ ((beta[:, h] * np.exp(gamma[:, h]))[:, None] * k[:, h])
        U = T @ (beta[:, h][:, None] * v[:, h])
        V_new = U - W @ S[h]
        qk = (q[:, h] @ k[:, h].T) * decay_causal[:, :, h]
        o[:, h] = np.exp(gamma[:, h])[:, None] * (q[:, h] @ S[h]) + qk @ V_new
        S_next[h] = np.exp(gamma[-1, h]) * S[h] + k[:, h].T @ (
            np.exp(gamma[-1, h] - gamma[:, h])[:, None] * V_new
        )
    return o, S_next


def delta_rule_chunked(q, k, v, beta, g, S, pos0: int = 0, chunk: int = CHUNK):
    """Chunked form with chunk boundaries at absolute positions that are multiples of `chunk`, so a
    sequence cut into calls anywhere gives the same chunks as one call (docs/numerics.md "Chunk alignment")."""
    n = q.shape[0]
    o = np.empty(v.shape)
    t = 0
    while t < n:
        end = min(n, t + chunk - (pos0 + t) % chunk)
        o[t:end], S = _chunk(q[t:end], k[t:end], v[t:end], beta[t:end], g[t:end], S)
        t = end
    return o, S


# ---------------------------------------------------------------------------------------------------
# Model


@dataclass
class HParams:
    arch: str
    n_layer: int  # main stack (block_count − nextn_predict_layers)
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_base: float
    rope_sections: tuple[int, ...]
    eps: float
    n_expert: int
    n_expert_used: int
    conv_kernel: int
    ssm_dk: int
    ssm_nk: int
    ssm_nv: int
    interval: int
    attn_scale: float

    def is_recurrent(self, il: int) -> bool:
        return (il + 1) % self.interval != 0


@dataclass
class State:
    """Per-slot sequence state: position, conv rows and S per DeltaNet layer, K/V per attention layer."""

    pos: int = 0
    conv: dict[int, np.ndarray] = field(default_factory=dict)
    ssm: dict[int, np.ndarray] = field(default_factory=dict)
    keys: dict[int, np.ndarray] = field(default_factory=dict)
    values: dict[int, np.ndarray] = field(default_factory=dict)

    def copy(self) -> State:
        return State(
            self.pos,
            {i: a.copy() for i, a in self.conv.items()},
            {i: a.copy() for i, a in self.ssm.items()},
            {i: a.copy() for i, a in self.keys.items()},
            {i: a.copy() for i, a in self.values.items()},
        )


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise KeyError(key)
        return default
    vals = [f.parts[i] for i in f.data]
    if len(vals) == 1 and f.types[0].name != "ARRAY":
        return vals[0][0].item()
    return [v[0].item() for v in vals]


class Model:
    """Weights of a GGUF dequantised to float64 (NumPy order: a GGUF ne = {in, out} weight is (out, in))."""

    def __init__(self, path: str | Path, *, act_quant: bool = False) -> None:
        """act_quant: round each matmul's activations as llama.cpp's CPU backend does for that weight's
        type (Q8_0 / Q8_K packing), so a quantised model can be compared tightly, not just loosely."""
        from gguf import GGUFReader
        from gguf.quants import dequantize

        reader = GGUFReader(str(path))
        arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
        if arch not in ("qwen3next", "qwen35moe"):
            raise ValueError(f"reference supports qwen3next / qwen35moe, not {arch}")
        a = arch
        n_all = _field(reader, f"{a}.block_count")
        hd = _field(reader, f"{a}.attention.key_length")
        self.hp = HParams(
            arch=arch,
            n_layer=n_all - _field(reader, f"{a}.nextn_predict_layers", 0),
            n_embd=_field(reader, f"{a}.embedding_length"),
            n_head=_field(reader, f"{a}.attention.head_count"),
            n_head_kv=_field(reader, f"{a}.attention.head_count_kv"),
            head_dim=hd,
            n_rot=_field(reader, f"{a}.rope.dimension_count"),
            rope_base=_field(reader, f"{a}.rope.freq_base"),
            rope_sections=tuple(_field(reader, f"{a}.rope.dimension_sections", [0, 0, 0, 0])),
            eps=_field(reader, f"{a}.attention.layer_norm_rms_epsilon"),
            n_expert=_field(reader, f"{a}.expert_count"),
            n_expert_used=_field(reader, f"{a}.expert_used_count"),
            conv_kernel=_field(reader, f"{a}.ssm.conv_kernel"),
            ssm_dk=_field(reader, f"{a}.ssm.state_size"),
            ssm_nk=_field(reader, f"{a}.ssm.group_count"),
            ssm_nv=_field(reader, f"{a}.ssm.time_step_rank"),
            interval=_field(reader, f"{a}.full_attention_interval", 4),
            attn_scale=_field(reader, f"{a}.attention.scale", 0.0) or 1.0 / np.sqrt(hd),
        )
        self.w: dict[str, np.ndarray] = {}
        for t in reader.tensors:
            shape = tuple(int(x) for x in reversed(t.shape))
            self.w[t.name] = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(shape)
        self.vocab_size = self.w["token_embd.weight"].shape[0]
        self.types = {t.name: t.tensor_type.name for t in reader.tensors}
        self.act_quant = act_quant
        # Per token of the last forward call: the smallest relative top-k routing margin over layers.
        self.route_margin = np.zeros(0)

    def act(self, x: np.ndarray, name: str) -> np.ndarray:
        """The activation operand as the matmul with weight `name` sees it."""
        rounding = activation_rounding(self.types[name]) if self.act_quant else None
        return x if rounding is None else rounding(x)

    def mm(self, x: np.ndarray, name: str) -> np.ndarray:
        """x · Wᵀ for the weight `name` (rows of x are tokens)."""
        return self.act(x, name) @ self.w[name].T

    # --- pieces ------------------------------------------------------------------------------------

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Partial NeoX RoPE on the first n_rot dims of each head; x: (n, heads, hd). For qwen35moe the
        sectioned IMROPE: rotary pair i takes its position from the t/h/w/e component its sector picks;
        text gives t = h = w = position and e = 0 (docs/numerics.md "Gated attention" step 3)."""
        hp = self.hp
        half = hp.n_rot // 2
        i = np.arange(half)
        inv_freq = hp.rope_base ** (-2.0 * i / hp.n_rot)
        p = np.broadcast_to(pos[:, None].astype(np.float64), (len(pos), half)).copy()
        if hp.arch == "qwen35moe":
            s = hp.rope_sections
            sector = i % sum(s)
            use_e = ~(
                ((sector % 3 == 1) & (sector < 3 * s[1]))
                | ((sector % 3 == 2) & (sector < 3 * s[2]))
                | ((sector % 3 == 0) & (sector < 3 * s[0]))
            )
            p[:, use_e] = 0.0
        ang = p * inv_freq  # (n, half)
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x = x.copy()
        x0, x1 = x[..., :half].copy(), x[..., half : hp.n_rot].copy()
        x[..., :half] = x0 * cos - x1 * sin
        x[..., half : hp.n_rot] = x0 * sin + x1 * cos
        return x

    def attention(self, il: int, u: np.ndarray, st: State) -> np.ndarray:
        hp, w, p = self.hp, self.w, f"blk.{il}."
        n, H, Hkv, hd = u.shape[0], hp.n_head, hp.n_head_kv, hp.head_dim
        if p + "attn_qkv.weight" in w:
            qkv = self.mm(u, p + "attn_qkv.weight")
            qfull, kx, vx = np.split(qkv, [2 * H * hd, 2 * H * hd + Hkv * hd], axis=1)
        else:
            qfull = self.mm(u, p + "attn_q.weight")
            kx, vx = self.mm(u, p + "attn_k.weight"), self.mm(u, p + "attn_v.weight")
        qfull = qfull.reshape(n, H, 2 * hd)
        q, gate = qfull[..., :hd], qfull[..., hd:]
        k, v = kx.reshape(n, Hkv, hd), vx.reshape(n, Hkv, hd)
        q = rms_norm(q, w[p + "attn_q_norm.weight"], hp.eps)
        k = rms_norm(k, w[p + "attn_k_norm.weight"], hp.eps)
        pos = np.arange(st.pos, st.pos + n)
        q, k = self._rope(q, pos), self._rope(k, pos)
        K = np.concatenate([st.keys.get(il, np.zeros((0, Hkv, hd))), k])
        V = np.concatenate([st.values.get(il, np.zeros((0, Hkv, hd))), v])
        st.keys[il], st.values[il] = K, V
        kv_head = np.arange(H) // (H // Hkv)
        scores = np.einsum("qhd,khd->hqk", q, K[:, kv_head]) * hp.attn_scale
        causal = np.arange(K.shape[0])[None, :] <= pos[:, None]
        scores = np.where(causal[None], scores, -np.inf)
        out = np.einsum("hqk,khd->qhd", softmax(scores), V[:, kv_head])
        out = (out * sigmoid(gate)).reshape(n, H * hd)
        return self.mm(out, p + "attn_output.weight")

    def _gdn_projections(self, il: int, u: np.ndarray):
        """(m = pre-conv q‖k‖v, z, b, a) in the file's v-head order (docs/numerics.md "Gated DeltaNet" step 1)."""
        hp, w, p = self.hp, self.w, f"blk.{il}."
        n, nk, nv, dk = u.shape[0], hp.ssm_nk, hp.ssm_nv, hp.ssm_dk
        r = nv // nk
        if p + "ssm_in.weight" in w:  # legacy qwen3next: per k-group [q ‖ k ‖ v (r heads) ‖ z (r heads)]
            mixed = (self.mm(u, p + "ssm_in.weight")).reshape(n, nk, 2 * dk + 2 * r * dk)
            q = mixed[:, :, :dk].reshape(n, -1)
            k = mixed[:, :, dk : 2 * dk].reshape(n, -1)
            v = mixed[:, :, 2 * dk : 2 * dk + r * dk].reshape(n, -1)
            z = mixed[:, :, 2 * dk + r * dk :].reshape(n, -1)
            m = np.concatenate([q, k, v], axis=1)
        else:
            m = self.mm(u, p + "attn_qkv.weight")
            z = self.mm(u, p + "attn_gate.weight")
        if hp.arch == "qwen3next":  # ssm_ba: per k-group [b of its r v-heads ‖ a of the same]
            ba = (self.mm(u, p + "ssm_ba.weight")).reshape(n, nk, 2 * r)
            b, a = ba[:, :, :r].reshape(n, nv), ba[:, :, r:].reshape(n, nv)
        else:
            b, a = self.mm(u, p + "ssm_beta.weight"), self.mm(u, p + "ssm_alpha.weight")
        return m, z, b, a

    def k_head_of_v_head(self) -> np.ndarray:
        """docs/numerics.md "Head pairing": qwen3next pairs consecutively (⌊n/r⌋), qwen35* tiles (n mod nk)."""
        hp = self.hp
        n = np.arange(hp.ssm_nv)
        return n // (hp.ssm_nv // hp.ssm_nk) if hp.arch == "qwen3next" else n % hp.ssm_nk

    def delta_net(self, il: int, u: np.ndarray, st: State, chunked: bool) -> np.ndarray:
        hp, w, p = self.hp, self.w, f"blk.{il}."
        n, nk, nv, dk, K = u.shape[0], hp.ssm_nk, hp.ssm_nv, hp.ssm_dk, hp.conv_kernel
        m, z, b, a = self._gdn_projections(il, u)
        beta = sigmoid(b)
        g = w[p + "ssm_a"] * softplus(a + w[p + "ssm_dt.bias"])
        conv_w = w[p + "ssm_conv1d.weight"]  # (channels, K), tap 0 = oldest
        prev = st.conv.get(il, np.zeros((K - 1, m.shape[1])))
        xin = np.concatenate([prev, m])
        y = sum(conv_w[:, j] * xin[j : j + n] for j in range(K))
        st.conv[il] = xin[-(K - 1) :].copy()
        y = silu(y)
        q = l2_norm(y[:, : nk * dk].reshape(n, nk, dk), hp.eps) / np.sqrt(dk)
        k = l2_norm(y[:, nk * dk : 2 * nk * dk].reshape(n, nk, dk), hp.eps)
        v = y[:, 2 * nk * dk :].reshape(n, nv, dk)
        pair = self.k_head_of_v_head()
        S = st.ssm.get(il, np.zeros((nv, dk, dk)))
        if chunked:
            o, S = delta_rule_chunked(q[:, pair], k[:, pair], v, beta, g, S, pos0=st.pos)
        else:
            o, S = delta_rule_recurrent(q[:, pair], k[:, pair], v, beta, g, S)
        st.ssm[il] = S
        o = rms_norm(o, w[p + "ssm_norm.weight"], hp.eps) * silu(z.reshape(n, nv, dk))
        return self.mm(o.reshape(n, nv * dk), p + "ssm_out.weight")

    def moe(self, il: int, x: np.ndarray) -> np.ndarray:
        hp, w, p = self.hp, self.w, f"blk.{il}."
        probs = softmax(self.mm(x, p + "ffn_gate_inp.weight"))
        order = np.argsort(-probs, axis=1, kind="stable")
        top = order[:, : hp.n_expert_used]
        if hp.n_expert_used < hp.n_expert:
            # How close the last chosen expert came to losing its place, relative to its probability.
            # Within f32 rounding an f32 implementation may legitimately pick the other expert, so
            # tests certify such routing near-ties rather than fail on them.
            last = np.take_along_axis(probs, order[:, hp.n_expert_used - 1 : hp.n_expert_used + 1], axis=1)
            margin = (last[:, 0] - last[:, 1]) / last[:, 0]
            self.route_margin = np.minimum(self.route_margin, margin)
        if p + "ffn_gate_up_exps.weight" in w:  # fused: gate = first ff rows, up = the next ff
            gu_name = p + "ffn_gate_up_exps.weight"
            ff = w[gu_name].shape[1] // 2
            gate_w, up_w = w[gu_name][:, :ff], w[gu_name][:, ff:]
            xg = xu = self.act(x, gu_name)
        else:
            gate_w, up_w = w[p + "ffn_gate_exps.weight"], w[p + "ffn_up_exps.weight"]
            xg, xu = self.act(x, p + "ffn_gate_exps.weight"), self.act(x, p + "ffn_up_exps.weight")
        down_name = p + "ffn_down_exps.weight"
        out = np.zeros_like(x)
        for t in range(x.shape[0]):
            sel = top[t]
            # llama.cpp clamps the renormalisation sum at 6.1e-5 (docs/numerics.md "MoE routing" step 3).
            weights = probs[t, sel] / max(np.sum(probs[t, sel]), 6.103515625e-5)
            for e, we in zip(sel, weights, strict=True):
                h = silu(gate_w[e] @ xg[t]) * (up_w[e] @ xu[t])
                out[t] += we * (w[down_name][e] @ self.act(h, down_name))
        shared = silu(self.mm(x, p + "ffn_gate_shexp.weight")) * self.mm(x, p + "ffn_up_shexp.weight")
        shared = self.mm(shared, p + "ffn_down_shexp.weight")
        sg = sigmoid(
            self.act(x, p + "ffn_gate_inp_shexp.weight") @ w[p + "ffn_gate_inp_shexp.weight"].reshape(-1)
        )
        return out + shared * sg[:, None]

    # --- whole model ---------------------------------------------------------------------------------

    def new_state(self) -> State:
        return State()

    def embed(self, tokens) -> np.ndarray:
        """Token rows of token_embd (no scaling): the hidden rows a first pipeline stage starts from."""
        return self.w["token_embd.weight"][np.asarray(tokens, dtype=np.int64)]

    def run_layers(self, x: np.ndarray, st: State, start: int = 0, end: int | None = None, *, chunked=True):
        """Hidden rows through layers [start, end) from the state's position on; advances the state.
        A pipeline stage owning those layers keeps its own State (docs/architecture.md "Split serving")."""
        hp, w = self.hp, self.w
        end = hp.n_layer if end is None else end
        self.route_margin = np.full(x.shape[0], np.inf)
        for il in range(start, end):
            p = f"blk.{il}."
            u = rms_norm(x, w[p + "attn_norm.weight"], hp.eps)
            if hp.is_recurrent(il):
                x = x + self.delta_net(il, u, st, chunked)
            else:
                x = x + self.attention(il, u, st)
            x = x + self.moe(il, rms_norm(x, w[p + "post_attention_norm.weight"], hp.eps))
        st.pos += x.shape[0]
        return x

    def head(self, x: np.ndarray) -> np.ndarray:
        """Final RMSNorm and LM head (token_embd when output.weight is absent)."""
        h = rms_norm(x, self.w["output_norm.weight"], self.hp.eps)
        return self.mm(h, "output.weight" if "output.weight" in self.w else "token_embd.weight")

    def forward(self, tokens, state: State | None = None, *, chunked: bool = True) -> np.ndarray:
        """Run `tokens` from the state's position on; returns logits (n, vocab) and advances the state.
        chunked selects the DeltaNet form (chunked prefill vs token recurrence); both are exact."""
        st = state if state is not None else State()
        return self.head(self.run_layers(self.embed(tokens), st, chunked=chunked))
