"""``python -m qk.info`` on small models written here with gguf-py: layer plan (Gated DeltaNet /
full attention / MTP), hyperparameters, per-layer and per-type sizes, totals, errors."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from qk import info

ARCH = "qwen35moe"


def write_hybrid(
    path, *, arch: str = ARCH, blocks: int = 6, mtp: int = 1, interval: int | None = 4, extra=None
):
    """A model with `blocks` blocks: per block an F32 norm {64} and a quantised weight {256, 2}
    (IQ4_XS, or Q8_0 in MTP blocks); plus token_embd F16 {64, 10}. Returns the writer's tensors
    as {name: (type, nbytes)}."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(blocks)
    w.add_uint32(f"{arch}.nextn_predict_layers", mtp)
    if interval is not None:
        w.add_uint32(f"{arch}.full_attention_interval", interval)
    w.add_uint32(f"{arch}.embedding_length", 64)
    w.add_uint32(f"{arch}.attention.head_count", 4)
    w.add_float32(f"{arch}.rope.freq_base", 1e7)
    w.add_uint32(f"{arch}.expert_count", 8)
    w.add_uint32(f"{arch}.ssm.conv_kernel", 4)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(10)])
    for k, v in (extra or {}).items():
        w.add_array(k, v)
    rng = np.random.default_rng(0)
    written = {}
    w.add_tensor("token_embd.weight", rng.standard_normal((10, 64)).astype(np.float16))
    written["token_embd.weight"] = ("F16", 10 * 64 * 2)
    for i in range(blocks):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(64, dtype=np.float32))
        written[f"blk.{i}.attn_norm.weight"] = ("F32", 64 * 4)
        q = Q.Q8_0 if i >= blocks - mtp else Q.IQ4_XS
        block_len, block_bytes = GGML_QUANT_SIZES[q]
        raw = np.zeros((2, 256 // block_len * block_bytes), dtype=np.uint8)
        w.add_tensor(f"blk.{i}.ffn_down_exps.weight", raw, raw_dtype=q)
        written[f"blk.{i}.ffn_down_exps.weight"] = (q.name, raw.size)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def run_info(capsys, *args) -> str:
    assert info.main([str(a) for a in args]) == 0
    return capsys.readouterr().out


def test_layer_plan_and_sizes(tmp_path, capsys) -> None:
    written = write_hybrid(tmp_path / "m.gguf")
    out = run_info(capsys, tmp_path / "m.gguf")
    assert f"architecture: {ARCH}" in out
    assert "layers: 6 blocks = 5 main + 1 MTP" in out
    # interval 4: layers 3 is full attention, 0-2 and 4 Gated DeltaNet, 5 is MTP.
    assert "Gated DeltaNet           4: 0-2, 4" in out
    assert "full attention           1: 3" in out
    assert "MTP (full attention)     1: 5" in out
    lines = out.splitlines()
    blk3 = next(line for line in lines if line.lstrip().startswith("blk.3 "))
    assert "full attention" in blk3 and "2 tensors" in blk3 and "IQ4_XS" in blk3
    blk5 = next(line for line in lines if line.lstrip().startswith("blk.5 "))
    assert "MTP" in blk5 and "Q8_0" in blk5
    assert "vocabulary               10" in out
    assert "RoPE base                10000000.0" in out
    assert "experts                  8" in out
    iq4 = [nb for ty, nb in written.values() if ty == "IQ4_XS"]
    assert f"IQ4_XS       {len(iq4)} tensors" in out
    assert f"{len(iq4) * 2 * 256:,} weights" in out
    total = sum(nb for _, nb in written.values())
    assert f"total: {len(written)} tensors" in out and f"{total:,} bytes" in out


def test_recurrent_layers_override_and_default_interval(tmp_path, capsys) -> None:
    write_hybrid(
        tmp_path / "n.gguf",
        arch="qwen3next",
        blocks=4,
        mtp=0,
        interval=None,
        extra={"qwen3next.attention.recurrent_layers": [True, False, False, True]},
    )
    out = run_info(capsys, tmp_path / "n.gguf")
    assert "Gated DeltaNet           2: 0, 3" in out
    assert "full attention           2: 1-2" in out
    write_hybrid(tmp_path / "d.gguf", blocks=8, mtp=0, interval=None)
    out = run_info(capsys, tmp_path / "d.gguf")
    assert "full attention           2: 3, 7" in out  # default interval 4


def test_header_only_and_errors(tmp_path, capsys) -> None:
    write_hybrid(tmp_path / "m.gguf")
    data = (tmp_path / "m.gguf").read_bytes()
    g = info.Gguf(tmp_path / "m.gguf")
    (tmp_path / "cut.gguf").write_bytes(data[: min(t.offset for t in g.tensors)])
    assert info.main([str(tmp_path / "cut.gguf")]) == 1
    assert "past the end" in capsys.readouterr().err
    out = run_info(capsys, "--header-only", tmp_path / "cut.gguf")
    assert "data: absent (header only)" in out and "layers: 6 blocks" in out
    assert info.main([str(tmp_path / "absent.gguf")]) == 1
    assert "absent.gguf" in capsys.readouterr().err


@pytest.mark.parametrize("indices, text", [([], ""), ([3], "3"), ([0, 1, 2, 4, 6, 7], "0-2, 4, 6-7")])
def test_ranges(indices, text) -> None:
    assert info.ranges(indices) == text


def test_module_entry_point(tmp_path) -> None:
    write_hybrid(tmp_path / "m.gguf")
    proc = subprocess.run(
        [sys.executable, "-m", "qk.info", str(tmp_path / "m.gguf")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "layers: 6 blocks = 5 main + 1 MTP" in proc.stdout


def write_typed(path, blocks: int, tensors: dict[str, Q], mtp: int = 0) -> None:
    """A model of `blocks` blocks holding one {256, 4} tensor per entry of `tensors`, in that type."""
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_block_count(blocks)
    w.add_uint32(f"{ARCH}.nextn_predict_layers", mtp)
    x = np.random.default_rng(2).standard_normal((4, 256)).astype(np.float32)
    for name, q in tensors.items():
        w.add_tensor(name, gguf.quants.quantize(x, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_lists_types_and_names_the_unsupported(tmp_path, capsys) -> None:
    # Q4_1 loads; TQ2_0 (ternary models only) does not.
    write_typed(tmp_path / "q.gguf", 2, {"blk.0.a": Q.Q4_1, "blk.1.b": Q.TQ2_0, "blk.1.c": Q.TQ2_0})
    out = run_info(capsys, tmp_path / "q.gguf")
    lines = out.splitlines()
    q41 = next(line for line in lines if line.lstrip().startswith("Q4_1 "))
    tq2 = next(line for line in lines if line.lstrip().startswith("TQ2_0 "))
    assert "1 tensors" in q41 and "1,024 weights" in q41 and "UNSUPPORTED" not in q41
    assert "2 tensors" in tq2 and tq2.endswith("UNSUPPORTED by qk")
    tq2_bytes = 2 * 4 * GGML_QUANT_SIZES[Q.TQ2_0][1]
    assert (
        f"total: 3 tensors, 3,072 weights, {4 * GGML_QUANT_SIZES[Q.Q4_1][1] * 8 + tq2_bytes:,} bytes" in out
    )
    assert lines[-1] == (
        "qk support: UNSUPPORTED tensor types, qk cannot load this model: TQ2_0 (2 tensors, first blk.1.b)"
    )


def test_unsupported_types_only_in_mtp_blocks_still_load(tmp_path, capsys) -> None:
    write_typed(tmp_path / "m.gguf", 2, {"blk.0.a": Q.Q8_0, "blk.1.b": Q.TQ2_0}, mtp=1)
    out = run_info(capsys, tmp_path / "m.gguf")
    assert out.splitlines()[-1] == (
        "qk support: the model loads; MTP blocks hold types qk cannot read: TQ2_0 (1 tensors, first blk.1.b)"
    )
    write_typed(tmp_path / "ok.gguf", 1, {"blk.0.a": Q.Q5_0, "blk.0.b": Q.Q5_1})
    assert run_info(capsys, tmp_path / "ok.gguf").splitlines()[-1] == "qk support: every tensor type loads"
