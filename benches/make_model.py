#!/usr/bin/env python3
"""A random-weight GGUF with the exact tensor shapes of a full-size model, for speed measurements
(its outputs are noise): the big matrices as IQ4_XS blocks, the embedding and LM head as Q8_0, norms,
routers and the other small tensors as F32 — the mix of a typical IQ4_XS download. Tensors are
written one at a time, so a 43 GB file needs no more than a few hundred MB of memory.

usage: python benches/make_model.py OUT.gguf --vocab VOCAB.gguf [--shape next80b|q35b] [--layers N]

VOCAB is any GGUF holding a Qwen2 BPE tokenizer (the llama-cpp-python sdist carries
vendor/llama.cpp/models/ggml-vocab-qwen2.gguf); its tokenizer.* keys are copied. Needs the `gguf`
package (PyPI, or gguf-py from that sdist).
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

# Hyperparameters of the real models (Qwen3-Next-80B-A3B; a Qwen3.5-MoE of 35B with 3B active).
SHAPES = {
    "next80b": dict(arch="qwen3next", n_embd=2048, n_layer=48, experts=512, used=10, ff=512, shared_ff=512,
                    heads=16, kv_heads=2, head_dim=256, n_rot=64, k_heads=16, v_heads=32, state=128),
    "q35b": dict(arch="qwen35moe", n_embd=2048, n_layer=40, experts=256, used=8, ff=512, shared_ff=512,
                 heads=16, kv_heads=2, head_dim=256, n_rot=64, k_heads=16, v_heads=32, state=128),
}  # fmt: skip

# (weights per block, bytes per block) of the quantised types written here.
BLOCKS = {Q.IQ4_XS: (256, 136), Q.Q8_0: (32, 34)}
# Block scales: small enough that activations stay finite through 48 random layers.
SCALE_F16 = {Q.IQ4_XS: np.float16(6.2e-5), Q.Q8_0: np.float16(1e-3)}


def tensor_plan(s: dict, n_layer: int, n_vocab: int) -> list[tuple[str, tuple[int, ...], Q]]:
    """(name, shape in ggml order — row length first, type) of every tensor, in file order."""
    e, hd = s["n_embd"], s["head_dim"]
    key_dim, value_dim = s["state"] * s["k_heads"], s["state"] * s["v_heads"]
    conv_dim = 2 * key_dim + value_dim
    plan = [
        ("token_embd.weight", (e, n_vocab), Q.Q8_0),
        ("output_norm.weight", (e,), Q.F32),
        ("output.weight", (e, n_vocab), Q.Q8_0),
    ]
    for i in range(n_layer):
        p = f"blk.{i}."
        layer = [(p + "attn_norm.weight", (e,), Q.F32), (p + "post_attention_norm.weight", (e,), Q.F32)]
        if (i + 1) % 4 == 0:  # every fourth layer is full attention, the rest gated DeltaNet
            layer += [
                (p + "attn_q.weight", (e, 2 * hd * s["heads"]), Q.IQ4_XS),
                (p + "attn_k.weight", (e, hd * s["kv_heads"]), Q.IQ4_XS),
                (p + "attn_v.weight", (e, hd * s["kv_heads"]), Q.IQ4_XS),
                (p + "attn_output.weight", (hd * s["heads"], e), Q.IQ4_XS),
                (p + "attn_q_norm.weight", (hd,), Q.F32),
                (p + "attn_k_norm.weight", (hd,), Q.F32),
            ]
        else:
            layer += [
                (p + "attn_qkv.weight", (e, conv_dim), Q.IQ4_XS),
                (p + "attn_gate.weight", (e, value_dim), Q.IQ4_XS),
                (p + "ssm_conv1d.weight", (4, conv_dim), Q.F32),
                (p + "ssm_dt.bias", (s["v_heads"],), Q.F32),
                (p + "ssm_a", (s["v_heads"],), Q.F32),
            ]
            if s["arch"] == "qwen35moe":
                layer += [
                    (p + "ssm_beta.weight", (e, s["v_heads"]), Q.F32),
                    (p + "ssm_alpha.weight", (e, s["v_heads"]), Q.F32),
                ]
            else:
                layer += [(p + "ssm_ba.weight", (e, 2 * s["v_heads"]), Q.F32)]
            layer += [
                (p + "ssm_norm.weight", (s["state"],), Q.F32),
                (p + "ssm_out.weight", (value_dim, e), Q.IQ4_XS),
            ]
        layer += [
            (p + "ffn_gate_inp.weight", (e, s["experts"]), Q.F32),
            (p + "ffn_gate_exps.weight", (e, s["ff"], s["experts"]), Q.IQ4_XS),
            (p + "ffn_up_exps.weight", (e, s["ff"], s["experts"]), Q.IQ4_XS),
            (p + "ffn_down_exps.weight", (s["ff"], e, s["experts"]), Q.IQ4_XS),
            (p + "ffn_gate_inp_shexp.weight", (e,), Q.F32),
            (p + "ffn_gate_shexp.weight", (e, s["shared_ff"]), Q.IQ4_XS),
            (p + "ffn_up_shexp.weight", (e, s["shared_ff"]), Q.IQ4_XS),
            (p + "ffn_down_shexp.weight", (s["shared_ff"], e), Q.IQ4_XS),
        ]
        plan += layer
    return plan


def nbytes(ne: tuple[int, ...], ty: Q) -> int:
    n = int(np.prod(ne))
    if ty == Q.F32:
        return 4 * n
    per_block, block_bytes = BLOCKS[ty]
    return n // per_block * block_bytes


def write_metadata(w: gguf.GGUFWriter, s: dict, n_layer: int, vocab_path: str) -> None:
    a = s["arch"]
    u32 = {
        "context_length": 262144,
        "embedding_length": s["n_embd"],
        "block_count": n_layer,
        "feed_forward_length": 5120,
        "attention.head_count": s["heads"],
        "attention.head_count_kv": s["kv_heads"],
        "attention.key_length": s["head_dim"],
        "attention.value_length": s["head_dim"],
        "rope.dimension_count": s["n_rot"],
        "expert_count": s["experts"],
        "expert_used_count": s["used"],
        "expert_feed_forward_length": s["ff"],
        "expert_shared_feed_forward_length": s["shared_ff"],
        "ssm.conv_kernel": 4,
        "ssm.inner_size": s["state"] * s["v_heads"],
        "ssm.state_size": s["state"],
        "ssm.time_step_rank": s["v_heads"],
        "ssm.group_count": s["k_heads"],
        "full_attention_interval": 4,
    }
    w.add_name(f"random-{a}")
    for key, value in u32.items():
        w.add_uint32(f"{a}.{key}", value)
    w.add_float32(f"{a}.rope.freq_base", 1e7)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    if a == "qwen35moe":
        w.add_array(f"{a}.rope.dimension_sections", [11, 11, 10, 0])
    w.add_uint32("general.file_type", int(gguf.LlamaFileType.MOSTLY_IQ4_XS))
    for key, field in gguf.GGUFReader(vocab_path).fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)


def tensor_data(name: str, ne: tuple[int, ...], ty: Q, rng: np.random.Generator) -> np.ndarray:
    shape = tuple(reversed(ne))
    if ty == Q.F32:
        if "norm" in name:
            return (1 + 0.05 * rng.standard_normal(shape)).astype(np.float32)
        if name.endswith("ssm_a"):
            return -np.exp(rng.uniform(-2, 0.5, shape)).astype(np.float32)
        return (0.05 * rng.standard_normal(shape)).astype(np.float32)
    per_block, block_bytes = BLOCKS[ty]
    n_blocks = nbytes(ne, ty) // block_bytes
    blocks = np.frombuffer(rng.bytes(n_blocks * block_bytes), np.uint8).reshape(n_blocks, block_bytes).copy()
    blocks[:, 0:2] = np.frombuffer(SCALE_F16[ty].tobytes(), np.uint8)  # the block's f16 scale d
    return blocks.reshape(shape[:-1] + (shape[-1] // per_block * block_bytes,))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--shape", default="next80b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, help="first N layers only (default: all)")
    a = ap.parse_args()
    s = SHAPES[a.shape]
    n_layer = a.layers or s["n_layer"]
    n_vocab = len(gguf.GGUFReader(a.vocab).fields["tokenizer.ggml.tokens"].data)
    plan = tensor_plan(s, n_layer, n_vocab)
    w = gguf.GGUFWriter(a.out, arch=s["arch"])
    write_metadata(w, s, n_layer, a.vocab)
    for name, ne, ty in plan:
        shape = tuple(reversed(ne))
        if ty == Q.F32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes(ne, ty))
        else:
            per_block, block_bytes = BLOCKS[ty]
            byte_shape = shape[:-1] + (shape[-1] // per_block * block_bytes,)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes(ne, ty), raw_dtype=ty)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, ne, ty in plan:
        w.write_tensor_data(tensor_data(name, ne, ty, rng))
    w.close()
    print(f"wrote {a.out}: {sum(nbytes(ne, ty) for _, ne, ty in plan) / 1e9:.1f} GB of tensors")


if __name__ == "__main__":
    main()
