"""CPU dequantisation (rust/gguf/dequant.rs, reached through ``qk.Gguf.array``) against gguf-py's
``gguf.quants.dequantize`` on random blocks: random bytes with finite fp16 scales."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import qk
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

# Byte offsets of the fp16 scale fields in each block (ggml-common.h block structs): random bytes
# there could be inf/NaN, which would turn whole blocks into NaN and hide wrong indexing. IQ1_M keeps
# its fp16 in the top nibbles of its four scale words, MXFP4 an E8M0 exponent byte (random_blocks).
SCALE_OFFSETS = {
    Q.Q4_0: [0],
    Q.Q4_1: [0, 2],
    Q.Q5_0: [0],
    Q.Q5_1: [0, 2],
    Q.Q8_0: [0],
    Q.Q2_K: [80, 82],
    Q.Q3_K: [108],
    Q.Q4_K: [0, 2],
    Q.Q5_K: [0, 2],
    Q.Q6_K: [208],
    Q.IQ1_S: [0],
    Q.IQ1_M: [],
    Q.IQ2_XXS: [0],
    Q.IQ2_XS: [0],
    Q.IQ2_S: [0],
    Q.IQ3_XXS: [0],
    Q.IQ3_S: [0],
    Q.IQ4_NL: [0],
    Q.IQ4_XS: [0],
    Q.MXFP4: [],
}
FLOAT_TYPES = [Q.F32, Q.F16, Q.BF16]
ROWS = 3
# Enough blocks that every grid entry appears: 3 rows × 400 blocks give IQ1's 2048-entry grid 38,400
# random indices (each entry missed with probability e^-18.75).
MANY_BLOCKS = 400


def random_blocks(qtype: Q, rng: np.random.Generator, blocks_per_row: int) -> np.ndarray:
    """ROWS rows of random blocks of `qtype`, as uint8 (rows, bytes per row)."""
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(ROWS, blocks_per_row, block_bytes), dtype=np.uint8)

    def scales() -> np.ndarray:
        return (rng.standard_normal((ROWS, blocks_per_row)) * 0.05).astype(np.float16).view(np.uint16)

    for off in SCALE_OFFSETS[qtype]:
        raw[:, :, off : off + 2] = scales().view(np.uint8).reshape(ROWS, blocks_per_row, 2)
    if qtype == Q.IQ1_M:
        d = scales()
        for k in range(4):  # nibble k of d in the top nibble of scale word k (bytes 48 + 2k, +1)
            top = 49 + 2 * k
            raw[:, :, top] = (raw[:, :, top] & 0x0F) | (((d >> (4 * k)) & 0xF).astype(np.uint8) << 4)
    if qtype == Q.MXFP4:
        # Every exponent up to 2^122 (e = 0 and 1 give subnormal scales); larger ones overflow x12.
        raw[:, :, 0] = rng.integers(0, 251, size=(ROWS, blocks_per_row), dtype=np.uint8)
    return raw.reshape(ROWS, -1)


def write_tensor(path, name: str, raw: np.ndarray, qtype: Q) -> None:
    w = gguf.GGUFWriter(str(path), "qwen35moe")
    w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("qtype", list(SCALE_OFFSETS), ids=lambda q: q.name)
def test_quantised_blocks_match_gguf_py(tmp_path, qtype: Q, seed: int) -> None:
    rng = np.random.default_rng([seed, int(qtype)])
    block_len, _ = GGML_QUANT_SIZES[qtype]
    blocks = MANY_BLOCKS if seed == 3 else int(rng.integers(1, 9))
    raw = random_blocks(qtype, rng, blocks_per_row=blocks)
    write_tensor(tmp_path / "q.gguf", "w", raw, qtype)
    expected = gguf.quants.dequantize(raw, qtype)
    got = qk.Gguf(tmp_path / "q.gguf").array("w")
    assert got.dtype == np.float32
    assert got.shape == expected.shape == (ROWS, raw.shape[1] // GGML_QUANT_SIZES[qtype][1] * block_len)
    assert np.isfinite(got).all()
    # Same formulas, same f32 operation order as ggml and gguf-py: bit-identical (signed zeros too).
    np.testing.assert_array_equal(got.view(np.uint32), expected.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("qtype", FLOAT_TYPES, ids=lambda q: q.name)
def test_float_types_match_gguf_py(tmp_path, qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    _, elem_bytes = GGML_QUANT_SIZES[qtype]
    # Every bit pattern, NaN and inf included: conversion must be exact, NaN must stay NaN.
    raw = rng.integers(0, 256, size=(ROWS, 64 * elem_bytes), dtype=np.uint8)
    write_tensor(tmp_path / "f.gguf", "w", raw, qtype)
    expected = gguf.quants.dequantize(raw, qtype)
    got = qk.Gguf(tmp_path / "f.gguf").array("w")
    assert got.shape == expected.shape == (ROWS, 64)
    np.testing.assert_array_equal(got, expected)


def test_quantiser_round_trip_q8_0(tmp_path) -> None:
    """Real quantised data (gguf-py's Q8_0 quantiser) dequantises close to the original."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    write_tensor(tmp_path / "q8.gguf", "w", gguf.quants.quantize(x, Q.Q8_0), Q.Q8_0)
    got = qk.Gguf(tmp_path / "q8.gguf").array("w")
    # Q8_0 rounds to the nearest of 255 steps, step d = max|x|/127 per 32-weight block: error <= d/2,
    # plus d itself stored as fp16 (relative error <= 2^-11) times |q| <= 127.
    d = np.abs(x.reshape(4, 2, 32)).max(axis=2, keepdims=True) / 127
    bound = d * (0.5 + 127 * 2.0**-11) + 1e-6
    assert (np.abs(got - x).reshape(4, 2, 32) <= bound).all()
