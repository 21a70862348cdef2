"""qk.testmodel: the tiny-model writer's vocabulary and tensor inventory against docs/numerics.md "Tensors", layout
variants that must not change the model, reproducible fixtures, and (with llama.cpp) that llama.cpp
loads and tokenizes what it writes, including the cached model with the real Qwen2 vocabulary."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from qk import testmodel
from reference.model import Model

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))

import make_models  # noqa: E402


def read(path: Path):
    from gguf import GGUFReader

    return GGUFReader(str(path))


def inventory(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    return {t.name: (tuple(int(x) for x in t.shape), t.tensor_type.name) for t in read(path).tensors}


def expected_inventory(arch: str, s: testmodel.Shape, layout: testmodel.Layout, n_vocab: int):
    """docs/numerics.md "Tensors": every tensor, its GGUF ne and (for the writer's F32 output) type."""
    E, ff, ffs, hd = s.n_expert, s.ff_exp, s.ff_shexp, s.head_dim
    want = {
        "token_embd.weight": (s.n_embd, n_vocab),
        "output_norm.weight": (s.n_embd,),
        "output.weight": (s.n_embd, n_vocab),
    }
    for il in range(s.n_layer + s.n_mtp):
        p = f"blk.{il}."
        want[p + "attn_norm.weight"] = (s.n_embd,)
        want[p + "post_attention_norm.weight"] = (s.n_embd,)
        if s.is_recurrent(il):
            if layout.legacy_ssm_in:
                want[p + "ssm_in.weight"] = (s.n_embd, 2 * s.key_dim + 2 * s.value_dim)
            else:
                want[p + "attn_qkv.weight"] = (s.n_embd, s.conv_dim)
                want[p + "attn_gate.weight"] = (s.n_embd, s.value_dim)
            want[p + "ssm_conv1d.weight"] = (s.conv_kernel, s.conv_dim)
            want[p + "ssm_dt.bias"] = (s.ssm_nv,)
            want[p + "ssm_a"] = (s.ssm_nv,)
            if arch == "qwen3next":
                want[p + "ssm_ba.weight"] = (s.n_embd, 2 * s.ssm_nv)
            else:
                want[p + "ssm_beta.weight"] = (s.n_embd, s.ssm_nv)
                want[p + "ssm_alpha.weight"] = (s.n_embd, s.ssm_nv)
            want[p + "ssm_norm.weight"] = (s.ssm_dk,)
            want[p + "ssm_out.weight"] = (s.value_dim, s.n_embd)
        else:
            q, kv = 2 * s.n_head * hd, s.n_head_kv * hd
            if layout.fused_attn_qkv:
                want[p + "attn_qkv.weight"] = (s.n_embd, q + 2 * kv)
            else:
                want[p + "attn_q.weight"] = (s.n_embd, q)
                want[p + "attn_k.weight"] = (s.n_embd, kv)
                want[p + "attn_v.weight"] = (s.n_embd, kv)
            want[p + "attn_output.weight"] = (s.n_head * hd, s.n_embd)
            want[p + "attn_q_norm.weight"] = (hd,)
            want[p + "attn_k_norm.weight"] = (hd,)
        want[p + "ffn_gate_inp.weight"] = (s.n_embd, E)
        if layout.fused_gate_up_exps:
            want[p + "ffn_gate_up_exps.weight"] = (s.n_embd, 2 * ff, E)
        else:
            want[p + "ffn_gate_exps.weight"] = (s.n_embd, ff, E)
            want[p + "ffn_up_exps.weight"] = (s.n_embd, ff, E)
        want[p + "ffn_down_exps.weight"] = (ff, s.n_embd, E)
        want[p + "ffn_gate_inp_shexp.weight"] = (s.n_embd,)
        want[p + "ffn_gate_shexp.weight"] = (s.n_embd, ffs)
        want[p + "ffn_up_shexp.weight"] = (s.n_embd, ffs)
        want[p + "ffn_down_shexp.weight"] = (ffs, s.n_embd)
        if il >= s.n_layer:
            want[p + "nextn.eh_proj.weight"] = (2 * s.n_embd, s.n_embd)
            for n in ("enorm", "hnorm", "shared_head_norm"):
                want[p + f"nextn.{n}.weight"] = (s.n_embd,)
    return {k: (v, "F32") for k, v in want.items()}


LAYOUTS = {
    "plain": testmodel.Layout(),
    "fused": testmodel.Layout(fused_gate_up_exps=True, fused_attn_qkv=True),
    "legacy": testmodel.Layout(legacy_ssm_in=True),
}


@pytest.mark.parametrize("arch", testmodel.ARCHES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_tensor_inventory_matches_spec(tmp_path, arch, layout):
    if layout == "legacy" and arch != "qwen3next":
        with pytest.raises(ValueError):
            testmodel.write_model(tmp_path / "m.gguf", arch, layout=LAYOUTS[layout])
        return
    shape = testmodel.small_shape(arch, n_mtp=1)
    path = testmodel.write_model(tmp_path / "m.gguf", arch, shape=shape, layout=LAYOUTS[layout])
    n_vocab = len(testmodel.make_vocab(shape.n_merges).tokens)
    assert inventory(path) == expected_inventory(arch, shape, LAYOUTS[layout], n_vocab)


@pytest.mark.parametrize("arch", testmodel.ARCHES)
def test_converter_conventions(arch):
    """+1 baked into zero-centred norms, ssm_a = −exp(A_log) < 0, real-file metadata."""
    m = Model(FIXTURES / f"tiny-{arch}-f32.gguf")
    norms = [k for k in m.w if k.endswith("norm.weight") and "ssm_norm" not in k]
    assert norms and all(abs(m.w[k].mean() - 1) < 0.1 for k in norms)
    assert all(np.all(m.w[k] < 0) for k in m.w if k.endswith("ssm_a"))
    # softplus(dt_bias) in HF's initial range [1e-3, 1e-1]
    dt = [np.logaddexp(0, m.w[k]) for k in m.w if k.endswith("ssm_dt.bias")]
    assert dt and all(np.all((d > 9e-4) & (d < 0.11)) for d in dt)
    r = read(FIXTURES / f"tiny-{arch}-f32.gguf")
    pre = bytes(r.fields["tokenizer.ggml.pre"].parts[-1]).decode()
    assert pre == ("qwen2" if arch == "qwen3next" else "qwen35")
    assert ("qwen35moe.rope.dimension_sections" in r.fields) == (arch == "qwen35moe")
    assert m.hp.n_head_kv < m.hp.n_head and m.hp.ssm_nv == 2 * m.hp.ssm_nk  # docs/numerics.md "Head pairing"


def test_vocabulary_is_valid_byte_level_bpe():
    v = testmodel.make_vocab()
    byte_chars = testmodel.bytes_to_unicode()
    assert len(set(byte_chars.values())) == 256
    assert v.tokens[:256] == [byte_chars[b] for b in range(256)]
    assert len(set(v.tokens)) == len(v.tokens)
    known = set(v.tokens)
    for m in v.merges:
        a, b = m.split(" ")
        assert a in known and b in known and a + b in known
    for s in testmodel.SPECIAL_TOKENS:
        want = testmodel.TOKEN_CONTROL if s.startswith("<|") else testmodel.TOKEN_USER_DEFINED
        assert v.token_types[v.id_of(s)] == want
    assert v.tokens[v.bos_id] == "<|endoftext|>" and v.tokens[v.eos_id] == "<|im_end|>"
    assert testmodel.make_vocab().tokens == v.tokens  # deterministic


def test_layout_variants_and_mtp_leave_the_model_unchanged(tmp_path):
    """Same seed: fused tensors are concatenations, ssm_in a reordering, MTP extra blocks the main pass
    never runs — so the reference gives bitwise-equal logits, exercising each of its layout paths."""
    tokens = list(range(0, 300, 7))
    for arch in testmodel.ARCHES:
        base = testmodel.write_model(
            tmp_path / f"{arch}-a.gguf", arch, seed=3, shape=testmodel.small_shape(arch)
        )
        layout = testmodel.Layout(True, arch == "qwen3next", True)
        var = testmodel.write_model(
            tmp_path / f"{arch}-b.gguf",
            arch,
            seed=3,
            shape=testmodel.small_shape(arch, n_mtp=1),
            layout=layout,
        )
        assert np.array_equal(Model(base).forward(tokens), Model(var).forward(tokens))


def test_committed_f32_fixtures_regenerate_identically(tmp_path):
    for arch, seed in make_models.SEEDS.items():
        committed = make_models.fixture_path(arch, "f32")
        fresh = testmodel.write_model(
            tmp_path / committed.name, arch, seed=seed, shape=testmodel.small_shape(arch), name=committed.stem
        )
        assert fresh.read_bytes() == committed.read_bytes()


@pytest.mark.oracle
def test_quantised_fixtures_regenerate_identically(tmp_path):
    pytest.importorskip("llama_cpp")
    arch = "qwen35moe"
    src = testmodel.write_model(
        tmp_path / f"tiny-{arch}-q-src-f32.gguf",
        arch,
        seed=make_models.SEEDS[arch],
        shape=testmodel.quantisable_shape(arch),
        name=f"tiny-{arch}-q-src-f32",
    )
    for kind, ftype in make_models.QUANTS.items():
        out = tmp_path / f"{kind}.gguf"
        make_models.quantize(src, out, ftype)
        assert out.read_bytes() == make_models.fixture_path(arch, kind).read_bytes()


@pytest.mark.oracle
@pytest.mark.parametrize("arch", testmodel.ARCHES)
def test_llama_cpp_tokenizes_with_the_tiny_vocabulary(arch):
    pytest.importorskip("llama_cpp")
    from reference import llama

    llm = llama.load(FIXTURES / f"tiny-{arch}-f32.gguf", n_ctx=64)
    v = testmodel.make_vocab()
    text = "<|im_start|>user\nHello world<|im_end|>\n<think>\n</think>\n<tool_call>ok</tool_call>"
    ids = llm.tokenize(text.encode(), add_bos=False, special=True)
    for s in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"):
        assert v.id_of(s) in ids
    assert llm.detokenize(ids, special=True).decode() == text
    # Text outside the merges still round-trips through the byte tokens.
    odd = "naïve café ☕ λ⁻⁴ 12345"
    assert llm.detokenize(llm.tokenize(odd.encode(), add_bos=False)).decode() == odd
    assert llm.token_eos() == v.eos_id


@pytest.mark.oracle
@pytest.mark.slow
def test_big_vocabulary_model(sdist_root):
    """The cached tiny model with the 151936-token Qwen2 vocabulary: its F32 LM head exceeds lavapipe's
    128 MiB binding limit, and llama.cpp tokenizes with it exactly as with ggml-vocab-qwen2.gguf."""
    pytest.importorskip("llama_cpp")
    from reference import llama

    path = make_models.big_vocab_model()
    kv, tensors = testmodel.read_gguf_header(path)
    ne, ggml_type = tensors["output.weight"]
    assert ggml_type == 0 and ne[1] == 151936 and ne[0] * ne[1] * 4 > 128 * 2**20  # F32, > 128 MiB
    assert kv["tokenizer.ggml.eos_token_id"] == 151645 and kv["tokenizer.ggml.bos_token_id"] == 151643
    llm = llama.load(path, n_ctx=64)
    vocab_dir = sdist_root / "vendor" / "llama.cpp" / "models"
    inputs = (vocab_dir / "ggml-vocab-qwen2.gguf.inp").read_text().split("\n__ggml_vocab_test__\n")
    outputs = (vocab_dir / "ggml-vocab-qwen2.gguf.out").read_text().split("\n")
    checked = 0
    for text, want in zip(inputs, outputs, strict=False):
        if not text:
            continue
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == [int(t) for t in want.split()]
        checked += 1
    assert checked > 30


def test_header_reader_agrees_with_gguf_py():
    path = FIXTURES / "tiny-qwen3next-q4_k_m.gguf"
    kv, tensors = testmodel.read_gguf_header(path)
    r = read(path)
    assert {t.name: (tuple(int(x) for x in t.shape), int(t.tensor_type)) for t in r.tensors} == tensors
    assert set(kv) == {k for k in r.fields if not k.startswith("GGUF.")}
    assert kv["tokenizer.ggml.tokens"] == testmodel.make_vocab().tokens
    assert kv["qwen3next.ssm.time_step_rank"] == 4


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "content": "sunny"},
    {"role": "tool", "content": "20C"},
    {"role": "assistant", "content": "Sunny, 20C."},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("arch", testmodel.ARCHES)
def test_chat_template_renders_chatml_with_tools(arch):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = read(FIXTURES / f"tiny-{arch}-f32.gguf").fields["tokenizer.chat_template"]
    text = bytes(template.parts[-1]).decode()
    render = ImmutableSandboxedEnvironment().from_string(text).render
    out = render(messages=CONVERSATION, tools=TOOLS, add_generation_prompt=True)
    assert out.startswith("<|im_start|>system\n") and out.count("Be brief.") == 1
    assert '"name": "get_weather"' in out  # the tool schema is listed
    # consecutive tool results merge into one user turn
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n20C\n" in out
    assert "<|im_start|>assistant\nSunny, 20C.<|im_end|>\n" in out
    if arch == "qwen3next":  # Qwen3: Hermes JSON calls, no think block in the prompt
        assert (
            '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            in out
        )
        assert out.endswith("<|im_start|>assistant\n")
    else:  # Qwen3.5: XML calls, thinking on unless disabled
        assert "<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n" in out
        assert out.endswith("<|im_start|>assistant\n<think>\n")
        plain = render(messages=CONVERSATION[1:2], add_generation_prompt=True, enable_thinking=False)
        assert (
            plain
            == "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        )
