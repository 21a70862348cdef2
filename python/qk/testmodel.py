"""Tiny random-weight GGUF models of the real architectures (qwen3next, qwen35moe): every tensor of
docs/numerics.md "Tensors" in the layout real converted files have, plus a small byte-level BPE vocabulary of
its own. Used by the test suite (fixtures, oracle comparisons) and by the server's built-in demo.

Only the generic `gguf.GGUFWriter` API is used, so both llama.cpp's gguf-py and the PyPI `gguf`
package can write these files.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ARCHES = ("qwen3next", "qwen35moe")

# GGUF token types (gguf-py TokenType).
TOKEN_NORMAL = 1
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

# Special tokens in the order the Qwen vocabularies place them (after the BPE tokens). `<|…|>` tokens
# are CONTROL in real files, the tag-like ones USER_DEFINED (docs/numerics.md "Vocabulary").
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)


@dataclass(frozen=True)
class Shape:
    """Hyper-parameters of a tiny model. Row lengths that llama.cpp's quantiser may turn into
    IQ4_XS / K-quants (n_embd, n_head·head_dim, nv·dk, ff_exp, ff_shexp) must be multiples of 256."""

    n_embd: int = 256
    n_layer: int = 2
    full_attention_interval: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_rot: int = 16
    rope_base: float = 5_000_000.0
    # Qwen3.5 M-RoPE sections (qwen35moe only; ggml requires sum ≤ head_dim). For text IMROPE equals
    # NeoX when rotary pair i's sector (i mod sum) falls in the t/h/w sections, as with [11, 11, 10, 0].
    rope_sections: tuple[int, int, int, int] = (11, 11, 10, 0)
    ssm_nk: int = 2
    ssm_nv: int = 4
    ssm_dk: int = 64
    conv_kernel: int = 4
    n_expert: int = 4
    n_expert_used: int = 2
    ff_exp: int = 256
    ff_shexp: int = 256
    n_merges: int = 200
    context_length: int = 4096
    rms_eps: float = 1e-6
    n_mtp: int = 0

    @property
    def key_dim(self) -> int:
        return self.ssm_nk * self.ssm_dk

    @property
    def value_dim(self) -> int:
        return self.ssm_nv * self.ssm_dk

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def is_recurrent(self, layer: int) -> bool:
        return layer < self.n_layer and (layer + 1) % self.full_attention_interval != 0

    def check(self) -> None:
        if self.ssm_nv % self.ssm_nk:
            raise ValueError("ssm_nv must be a multiple of ssm_nk")
        if self.n_head % self.n_head_kv:
            raise ValueError("n_head must be a multiple of n_head_kv")
        if self.n_rot > self.head_dim or self.n_rot % 2:
            raise ValueError("n_rot must be even and at most head_dim")
        if sum(self.rope_sections) > self.head_dim:
            raise ValueError("ggml requires sum(rope_sections) <= head_dim")


@dataclass(frozen=True)
class Layout:
    """Tensor layout variants seen in real files that llama.cpp 0.3.36 loads (docs/numerics.md "Tensors")."""

    fused_gate_up_exps: bool = False  # ffn_gate_up_exps instead of ffn_gate_exps + ffn_up_exps
    legacy_ssm_in: bool = False  # qwen3next only: ssm_in (HF in_proj_qkvz) instead of attn_qkv + attn_gate
    fused_attn_qkv: bool = False  # attention layers: attn_qkv instead of attn_q/attn_k/attn_v


@dataclass
class Vocab:
    """A gpt2-style (byte-level BPE) vocabulary as stored in GGUF."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    pre: str
    bos_id: int
    eos_id: int
    pad_id: int

    def id_of(self, text: str) -> int:
        return self.tokens.index(text)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character table: printable Latin-1 bytes map to
    themselves, the rest to code points 256, 257, … in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# Text the tiny BPE vocabulary is trained on: chat markup, English and a little code, so that common
# prompt words become single tokens while anything else still tokenizes through the byte tokens.
_CORPUS = """
<|im_start|>system
You are a helpful assistant. Answer the user's questions clearly and briefly.<|im_end|>
<|im_start|>user
Hello! What is the capital of France, and why is the sky blue?<|im_end|>
<|im_start|>assistant
The capital of France is Paris. The sky is blue because the air scatters blue light from the sun
more than it scatters red light. This is called Rayleigh scattering.<|im_end|>
<|im_start|>user
Write a function that returns the sum of a list of numbers in Python.<|im_end|>
<|im_start|>assistant
def total(numbers):
    result = 0
    for number in numbers:
        result += number
    return result
<|im_end|>
The quick brown fox jumps over the lazy dog. There is a time for every thing, and the model
should think about the question before it gives an answer. We read the file, parse the tool call,
and return the response to the user. The weather today is sunny with a light wind from the west.
Once upon a time there was a little model that wanted to learn how to speak with people.
"""

_PRETOKENIZE = re.compile(
    r"""'(?:[sS]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD])|[^\r\n\w]?[^\W\d_]+|\d| ?[^\s\w]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def make_vocab(n_merges: int = 200, pre: str = "qwen2") -> Vocab:
    """Train `n_merges` byte-level BPE merges on the built-in corpus; tokens = 256 byte tokens, then
    one token per merge, then the Qwen special tokens (endoftext = bos/pad, im_end = eos)."""
    byte_char = bytes_to_unicode()
    text = _CORPUS
    for special in SPECIAL_TOKENS:
        text = text.replace(special, " ")
    words = Counter("".join(byte_char[b] for b in w.encode()) for w in _PRETOKENIZE.findall(text))
    pieces = {w: list(w) for w in words}
    tokens = [byte_char[b] for b in range(256)]
    known = set(tokens)
    merges: list[str] = []
    while len(merges) < n_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for w, n in words.items():
            p = pieces[w]
            for a, b in zip(p, p[1:], strict=False):
                pairs[(a, b)] += n
        if not pairs:
            break
        # Ties broken by the pair text so the vocabulary is the same on every machine.
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        merges.append(f"{a} {b}")
        if a + b not in known:
            known.add(a + b)
            tokens.append(a + b)
        for w in words:
            p = pieces[w]
            out, i = [], 0
            while i < len(p):
                if i + 1 < len(p) and p[i] == a and p[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(p[i])
                    i += 1
            pieces[w] = out
    types = [TOKEN_NORMAL] * len(tokens)
    first_special = len(tokens)
    for s in SPECIAL_TOKENS:
        tokens.append(s)
        types.append(TOKEN_CONTROL if s.startswith("<|") else TOKEN_USER_DEFINED)
    ids = {s: first_special + i for i, s in enumerate(SPECIAL_TOKENS)}
    return Vocab(
        tokens=tokens,
        token_types=types,
        merges=merges,
        pre=pre,
        bos_id=ids["<|endoftext|>"],
        eos_id=ids["<|im_end|>"],
        pad_id=ids["<|endoftext|>"],
    )


_SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}


def read_gguf_header(path: str | Path) -> tuple[dict[str, object], dict[str, tuple[tuple[int, ...], int]]]:
    """(key/value pairs, {tensor name: (ne, ggml type id)}) of a GGUF file (v2/v3, little-endian).
    gguf.GGUFReader takes ~40 s on a 150k-token vocabulary; this plain parser well under a second."""
    import struct

    data = Path(path).read_bytes()
    if data[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    (version,) = struct.unpack_from("<I", data, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version}")
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    off = 24

    def string() -> str:
        nonlocal off
        (n,) = struct.unpack_from("<Q", data, off)
        off += 8 + n
        return data[off - n : off].decode("utf-8")

    def value(vtype: int):
        nonlocal off
        if vtype == 8:
            return string()
        if vtype == 9:
            sub, n = struct.unpack_from("<IQ", data, off)
            off += 12
            if sub in _SCALAR_FORMATS:
                fmt = _SCALAR_FORMATS[sub]
                size = struct.calcsize(fmt)
                items = list(struct.unpack_from(f"<{n}{fmt[1]}", data, off))
                off += n * size
                return items
            return [value(sub) for _ in range(n)]
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise ValueError(f"{path}: unknown GGUF value type {vtype}")
        (v,) = struct.unpack_from(fmt, data, off)
        off += struct.calcsize(fmt)
        return v

    out: dict[str, object] = {}
    for _ in range(n_kv):
        key = string()
        (vtype,) = struct.unpack_from("<I", data, off)
        off += 4
        out[key] = value(vtype)
    tensors: dict[str, tuple[tuple[int, ...], int]] = {}
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", data, off)
        ne = struct.unpack_from(f"<{n_dims}Q", data, off + 4)
        off += 4 + 8 * n_dims
        ggml_type, _offset = struct.unpack_from("<IQ", data, off)
        off += 12
        tensors[name] = (tuple(ne), ggml_type)
    return out, tensors


def vocab_from_gguf(path: str | Path) -> Vocab:
    """The tokenizer of an existing GGUF (e.g. llama.cpp's ggml-vocab-qwen2.gguf test vocabulary)."""
    kv, _ = read_gguf_header(path)
    bos = int(kv["tokenizer.ggml.bos_token_id"])
    return Vocab(
        tokens=list(kv["tokenizer.ggml.tokens"]),
        token_types=[int(t) for t in kv["tokenizer.ggml.token_type"]],
        merges=list(kv["tokenizer.ggml.merges"]),
        pre=str(kv["tokenizer.ggml.pre"]),
        bos_id=bos,
        eos_id=int(kv["tokenizer.ggml.eos_token_id"]),
        pad_id=int(kv.get("tokenizer.ggml.padding_token_id", bos)),
    )


# ChatML templates in the shape of the real ones (docs/numerics.md "Vocabulary"): Qwen3 (Hermes JSON tool calls)
# for qwen3next, Qwen3.5 (XML function calls, thinking on by default) for qwen35moe.
CHAT_TEMPLATE_QWEN3 = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- set call = tool_call.function if tool_call.function is defined else tool_call %}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

CHAT_TEMPLATE_QWEN35 = """{%- if tools %}
{{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call>' }}
{%- if messages[0].role == 'system' %}{{- '\\n\\n' + messages[0].content }}{%- endif %}
{{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}
{{- message.content or '' }}
{%- for tool_call in message.tool_calls or [] %}
{%- set call = tool_call.function if tool_call.function is defined else tool_call %}
{%- if loop.first and message.content %}{{- '\\n\\n' }}{%- elif not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n<function=' + call.name + '>\\n' }}
{%- set args = call.arguments if call.arguments is mapping else {} %}
{%- for name, value in args.items() %}
{{- '<parameter=' + name + '>\\n' }}
{%- if value is string %}{{- value }}{%- else %}{{- value | tojson }}{%- endif %}
{{- '\\n</parameter>\\n' }}
{%- endfor %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


class _Weights:
    """Random weights scaled so that activations stay O(1) through the stack."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def linear(self, n_out: int, n_in: int, *lead: int) -> np.ndarray:
        """A weight of GGUF ne = {n_in, n_out, *lead}: NumPy shape (*lead, n_out, n_in)."""
        return _f32(self.rng.standard_normal((*lead, n_out, n_in)) / np.sqrt(n_in))

    def norm_plus_one(self, n: int) -> np.ndarray:
        """A zero-centred HF norm weight with the converter's +1 baked in."""
        return _f32(1.0 + 0.1 * self.rng.standard_normal(n))


def _softplus_inverse(y: np.ndarray) -> np.ndarray:
    return y + np.log(-np.expm1(-y))


# Router gain of the committed fixtures: decisive expert choices, so that llama.cpp's 8-bit rounding of
# activations on quantised files rarely flips a top-k pick. 1.0 is the routers' natural scale (their
# rows drawn like every other projection's), which the weight-type parity fixtures use.
DECISIVE_ROUTER_GAIN = 3.0


def _tensors(
    arch: str,
    shape: Shape,
    layout: Layout,
    vocab_size: int,
    seed: int,
    lm_head_gain: float,
    router_gain: float,
):
    """(name, F32 array in NumPy order) for every tensor of the model, in file order."""
    s = shape
    w = _Weights(seed)
    out: list[tuple[str, np.ndarray]] = []
    out.append(("token_embd.weight", _f32(w.rng.standard_normal((vocab_size, s.n_embd)))))
    hd, nk, nv, dk = s.head_dim, s.ssm_nk, s.ssm_nv, s.ssm_dk
    r = nv // nk

    def attention(p: str) -> None:
        q = w.linear(2 * s.n_head * hd, s.n_embd)  # rows per head: [query (hd) ‖ gate (hd)]
        k = w.linear(s.n_head_kv * hd, s.n_embd)
        v = w.linear(s.n_head_kv * hd, s.n_embd)
        if layout.fused_attn_qkv:
            out.append((f"{p}.attn_qkv.weight", _f32(np.concatenate([q, k, v]))))
        else:
            out.extend([(f"{p}.attn_q.weight", q), (f"{p}.attn_k.weight", k), (f"{p}.attn_v.weight", v)])
        out.append((f"{p}.attn_output.weight", w.linear(s.n_embd, s.n_head * hd)))
        out.append((f"{p}.attn_q_norm.weight", w.norm_plus_one(hd)))
        out.append((f"{p}.attn_k_norm.weight", w.norm_plus_one(hd)))

    def delta_net(p: str) -> None:
        q = w.linear(s.key_dim, s.n_embd)
        k = w.linear(s.key_dim, s.n_embd)
        v = w.linear(s.value_dim, s.n_embd)
        z = w.linear(s.value_dim, s.n_embd)
        if layout.legacy_ssm_in:
            # HF in_proj_qkvz: per k-group g, [q_g ‖ k_g ‖ v of v-heads g·r… ‖ z of the same].
            groups = []
            for g in range(nk):
                vs = slice(g * r * dk, (g + 1) * r * dk)
                groups += [q[g * dk : (g + 1) * dk], k[g * dk : (g + 1) * dk], v[vs], z[vs]]
            out.append((f"{p}.ssm_in.weight", _f32(np.concatenate(groups))))
        else:
            out.append((f"{p}.attn_qkv.weight", _f32(np.concatenate([q, k, v]))))
            out.append((f"{p}.attn_gate.weight", z))
        out.append((f"{p}.ssm_conv1d.weight", _f32(w.rng.standard_normal((s.conv_dim, s.conv_kernel)) / 2.0)))
        # HF initialisation: softplus(dt_bias) in [1e-3, 1e-1] log-uniform, A in [1, 16].
        dt = np.exp(w.rng.uniform(np.log(1e-3), np.log(1e-1), nv))
        out.append((f"{p}.ssm_dt.bias", _f32(_softplus_inverse(dt))))
        a_log = np.log(w.rng.uniform(1.0, 16.0, nv))
        out.append((f"{p}.ssm_a", _f32(-np.exp(a_log))))  # the converter stores −exp(A_log)
        if arch == "qwen3next":
            out.append((f"{p}.ssm_ba.weight", w.linear(2 * nv, s.n_embd)))  # per group [b (r) ‖ a (r)]
        else:
            out.append((f"{p}.ssm_beta.weight", w.linear(nv, s.n_embd)))
            out.append((f"{p}.ssm_alpha.weight", w.linear(nv, s.n_embd)))
        out.append((f"{p}.ssm_norm.weight", _f32(1.0 + 0.1 * w.rng.standard_normal(dk))))  # raw, no +1
        out.append((f"{p}.ssm_out.weight", w.linear(s.n_embd, s.value_dim)))

    def moe(p: str) -> None:
        out.append((f"{p}.ffn_gate_inp.weight", _f32(router_gain * w.linear(s.n_expert, s.n_embd))))
        gate = w.linear(s.ff_exp, s.n_embd, s.n_expert)
        up = w.linear(s.ff_exp, s.n_embd, s.n_expert)
        if layout.fused_gate_up_exps:
            out.append((f"{p}.ffn_gate_up_exps.weight", _f32(np.concatenate([gate, up], axis=1))))
        else:
            out.extend([(f"{p}.ffn_gate_exps.weight", gate), (f"{p}.ffn_up_exps.weight", up)])
        out.append((f"{p}.ffn_down_exps.weight", w.linear(s.n_embd, s.ff_exp, s.n_expert)))
        out.append(
            (f"{p}.ffn_gate_inp_shexp.weight", _f32(w.rng.standard_normal(s.n_embd) / np.sqrt(s.n_embd)))
        )
        out.append((f"{p}.ffn_gate_shexp.weight", w.linear(s.ff_shexp, s.n_embd)))
        out.append((f"{p}.ffn_up_shexp.weight", w.linear(s.ff_shexp, s.n_embd)))
        out.append((f"{p}.ffn_down_shexp.weight", w.linear(s.n_embd, s.ff_shexp)))

    def block(il: int) -> None:
        p = f"blk.{il}"
        out.append((f"{p}.attn_norm.weight", w.norm_plus_one(s.n_embd)))
        if s.is_recurrent(il):
            delta_net(p)
        else:
            attention(p)
        out.append((f"{p}.post_attention_norm.weight", w.norm_plus_one(s.n_embd)))
        moe(p)

    for il in range(s.n_layer):
        block(il)
    out.append(("output_norm.weight", w.norm_plus_one(s.n_embd)))
    out.append(("output.weight", _f32(lm_head_gain * w.linear(vocab_size, s.n_embd))))
    # MTP blocks draw from their own generator, so adding them leaves the main model's weights (and
    # so its logits) unchanged. The main pass never runs them (docs/numerics.md "Layer plan").
    w = _Weights(seed + 1_000_003)
    for il in range(s.n_layer, s.n_layer + s.n_mtp):
        block(il)
        p = f"blk.{il}"
        out.append((f"{p}.nextn.eh_proj.weight", w.linear(s.n_embd, 2 * s.n_embd)))
        out.append((f"{p}.nextn.enorm.weight", w.norm_plus_one(s.n_embd)))
        out.append((f"{p}.nextn.hnorm.weight", w.norm_plus_one(s.n_embd)))
        out.append((f"{p}.nextn.shared_head_norm.weight", w.norm_plus_one(s.n_embd)))
    return out


def write_model(
    path: str | Path,
    arch: str = "qwen35moe",
    *,
    seed: int = 0,
    shape: Shape | None = None,
    layout: Layout | None = None,
    vocab: Vocab | None = None,
    lm_head_gain: float = 4.0,
    router_gain: float = DECISIVE_ROUTER_GAIN,
    name: str | None = None,
) -> Path:
    """Write a tiny random-weight F32 GGUF of `arch` to `path`.

    lm_head_gain scales output.weight: with unit-variance logits a random model's top-2 gaps are so
    small that near-ties dominate greedy comparisons (docs/architecture.md "Test data"). router_gain scales the
    MoE routers (ffn_gate_inp): DECISIVE_ROUTER_GAIN by default, as the committed fixtures have it;
    1.0 for routers at their natural scale."""
    import gguf

    if arch not in ARCHES:
        raise ValueError(f"arch must be one of {ARCHES}, not {arch!r}")
    s = shape or quantisable_shape(arch)
    s.check()
    layout = layout or Layout()
    if layout.legacy_ssm_in and arch != "qwen3next":
        raise ValueError("the legacy ssm_in layout exists only for qwen3next")
    vocab = vocab or make_vocab(s.n_merges, pre="qwen2" if arch == "qwen3next" else "qwen35")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    wr = gguf.GGUFWriter(str(path), arch)
    a = arch
    wr.add_string("general.name", name or f"qk-tiny-{arch}-s{seed}")
    wr.add_uint32("general.file_type", 0)  # ALL_F32
    wr.add_uint32(f"{a}.block_count", s.n_layer + s.n_mtp)
    if s.n_mtp:
        wr.add_uint32(f"{a}.nextn_predict_layers", s.n_mtp)
    wr.add_uint32(f"{a}.context_length", s.context_length)
    wr.add_uint32(f"{a}.embedding_length", s.n_embd)
    wr.add_uint32(f"{a}.feed_forward_length", s.ff_exp * s.n_expert_used)
    wr.add_uint32(f"{a}.attention.head_count", s.n_head)
    wr.add_uint32(f"{a}.attention.head_count_kv", s.n_head_kv)
    wr.add_uint32(f"{a}.attention.key_length", s.head_dim)
    wr.add_uint32(f"{a}.attention.value_length", s.head_dim)
    wr.add_float32(f"{a}.attention.layer_norm_rms_epsilon", s.rms_eps)
    wr.add_float32(f"{a}.rope.freq_base", s.rope_base)
    wr.add_uint32(f"{a}.rope.dimension_count", s.n_rot)
    if arch == "qwen35moe":
        wr.add_array(f"{a}.rope.dimension_sections", [int(x) for x in s.rope_sections])
    wr.add_uint32(f"{a}.expert_count", s.n_expert)
    wr.add_uint32(f"{a}.expert_used_count", s.n_expert_used)
    wr.add_uint32(f"{a}.expert_feed_forward_length", s.ff_exp)
    wr.add_uint32(f"{a}.expert_shared_feed_forward_length", s.ff_shexp)
    wr.add_uint32(f"{a}.ssm.conv_kernel", s.conv_kernel)
    wr.add_uint32(f"{a}.ssm.state_size", s.ssm_dk)
    wr.add_uint32(f"{a}.ssm.group_count", s.ssm_nk)
    wr.add_uint32(f"{a}.ssm.time_step_rank", s.ssm_nv)
    wr.add_uint32(f"{a}.ssm.inner_size", s.value_dim)
    wr.add_uint32(f"{a}.full_attention_interval", s.full_attention_interval)

    wr.add_string("tokenizer.ggml.model", "gpt2")
    wr.add_string("tokenizer.ggml.pre", vocab.pre)
    wr.add_array("tokenizer.ggml.tokens", vocab.tokens)
    wr.add_array("tokenizer.ggml.token_type", [int(t) for t in vocab.token_types])
    wr.add_array("tokenizer.ggml.merges", vocab.merges)
    wr.add_uint32("tokenizer.ggml.bos_token_id", vocab.bos_id)
    wr.add_uint32("tokenizer.ggml.eos_token_id", vocab.eos_id)
    wr.add_uint32("tokenizer.ggml.padding_token_id", vocab.pad_id)
    wr.add_bool("tokenizer.ggml.add_bos_token", False)
    wr.add_string(
        "tokenizer.chat_template", CHAT_TEMPLATE_QWEN3 if arch == "qwen3next" else CHAT_TEMPLATE_QWEN35
    )

    for tname, data in _tensors(arch, s, layout, len(vocab.tokens), seed, lm_head_gain, router_gain):
        wr.add_tensor(tname, data)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def quantisable_shape(arch: str, **changes) -> Shape:
    """The smallest shape whose quantisable rows are all multiples of 256 (for IQ4_XS / K-quants):
    one DeltaNet and one attention layer, 4 experts (2 used), GQA 4/2, nv = 2·nk."""
    return replace(Shape(rope_base=5e6 if arch == "qwen3next" else 1e7), **changes)


def small_shape(arch: str, **changes) -> Shape:
    """A much smaller F32-only shape with the real layer pattern (interval 4: three DeltaNet layers,
    then attention), 8 experts (2 used), GQA 4/2, nv = 2·nk."""
    base = Shape(
        n_embd=64,
        n_layer=4,
        full_attention_interval=4,
        n_head=4,
        n_head_kv=2,
        head_dim=32,
        n_rot=8,
        rope_base=5e6 if arch == "qwen3next" else 1e7,
        ssm_nk=2,
        ssm_nv=4,
        ssm_dk=16,
        n_expert=8,
        n_expert_used=2,
        ff_exp=64,
        ff_shexp=64,
    )
    return replace(base, **changes)
