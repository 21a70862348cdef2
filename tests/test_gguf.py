"""``qk.Gguf``: metadata, the tensor table and tensor data of files written by gguf-py, split models,
header-only reading, and typed errors for malformed input."""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import qk
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from hypothesis import given, settings
from hypothesis import strategies as st


def write_model(path, *, split_max_tensors: int = 0, extra_kv: dict | None = None) -> dict[str, np.ndarray]:
    """A small model file with every metadata value type; returns the float tensors written."""
    w = gguf.GGUFWriter(str(path), "qwen35moe", split_max_tensors=split_max_tensors)
    w.add_block_count(5)
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -70000)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**64 - 1)
    w.add_int64("t.i64", -(2**63))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", False)
    w.add_string("t.str", "ünïcode ✓")
    w.add_array("t.arr_i", [1, 2, 3])
    w.add_array("t.arr_s", ["x", "", "zz"])
    w.add_array("t.arr_f", [0.5, -1.5])
    w.add_array("t.nested", [[1, 2], [3], [["deep"]]])
    for k, v in (extra_kv or {}).items():
        w.add_string(k, v)
    rng = np.random.default_rng(0)
    tensors = {
        "token_embd.weight": rng.standard_normal((6, 32)).astype(np.float32),
        "blk.0.attn_norm.weight": rng.standard_normal(32).astype(np.float32),
        "blk.0.ffn_gate_exps.weight": rng.standard_normal((2, 3, 32)).astype(np.float16),
    }
    for name, t in tensors.items():
        w.add_tensor(name, t)
    q = rng.standard_normal((2, 64)).astype(np.float32)
    w.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(q, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model.gguf"
    return path, write_model(path)


def test_metadata_types(model) -> None:
    path, _ = model
    g = qk.Gguf(path)
    m = g.metadata
    assert g.arch == m["general.architecture"] == "qwen35moe"
    assert (g.version, g.alignment) == (3, 32)
    expected = {
        "qwen35moe.block_count": 5,
        "t.u8": 250,
        "t.i8": -7,
        "t.u16": 65000,
        "t.i16": -300,
        "t.u32": 4_000_000_000,
        "t.i32": -70000,
        "t.f32": 0.25,
        "t.u64": 2**64 - 1,
        "t.i64": -(2**63),
        "t.f64": 1e-300,
        "t.bool": False,
        "t.str": "ünïcode ✓",
        "t.arr_i": [1, 2, 3],
        "t.arr_s": ["x", "", "zz"],
        "t.arr_f": [0.5, -1.5],
        "t.nested": [[1, 2], [3], [["deep"]]],
    }
    for key, value in expected.items():
        assert m[key] == value, key
        assert type(m[key]) is type(value), key
    assert list(m)[0] == "general.architecture"


def test_tensor_table_matches_gguf_py_reader(model) -> None:
    path, _ = model
    g = qk.Gguf(path)
    ref = gguf.GGUFReader(path)
    assert len(g) == len(ref.tensors) == 4
    for rt in ref.tensors:
        t = g.tensor(rt.name)
        assert rt.name in g
        assert t.type == rt.tensor_type.name
        assert t.type_id == int(rt.tensor_type)
        assert t.ne == tuple(int(d) for d in rt.shape)
        assert t.shape == tuple(reversed(t.ne))
        assert t.offset == rt.data_offset
        assert t.nbytes == rt.n_bytes
        assert t.shard == 0
        assert t.offset % g.alignment == 0
        np.testing.assert_array_equal(g.raw(rt.name), np.asarray(rt.data).reshape(-1).view(np.uint8))
    assert "nope" not in g
    with pytest.raises(KeyError):
        g.tensor("nope")
    with pytest.raises(KeyError):
        g.raw("nope")


def test_arrays_in_numpy_shape(model) -> None:
    path, tensors = model
    g = qk.Gguf(path)
    for name, t in tensors.items():
        got = g.array(name)
        assert got.dtype == np.float32 and got.shape == t.shape, name
        np.testing.assert_array_equal(got, t.astype(np.float32))
    assert g.tensor("blk.0.ffn_gate_exps.weight").ne == (32, 3, 2)


def test_fingerprint_stable_across_processes(model, tmp_path) -> None:
    path, _ = model
    fp = qk.Gguf(path).fingerprint
    assert len(fp) == 64 and int(fp, 16) >= 0
    code = f"import qk; print(qk.Gguf({os.fspath(path)!r}).fingerprint)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == fp
    other = tmp_path / "other.gguf"
    write_model(other, extra_kv={"general.name": "different"})
    assert qk.Gguf(other).fingerprint != fp


def test_header_only_on_truncated_file(model, tmp_path) -> None:
    path, _ = model
    full = qk.Gguf(path)
    data_start = min(t.offset for t in full.tensors)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:data_start])
    with pytest.raises(qk.GgufError, match="past the end"):
        qk.Gguf(cut)
    h = qk.Gguf(cut, header_only=True)
    assert h.header_only and not full.header_only
    assert h.tensors == full.tensors
    assert h.metadata == full.metadata
    assert h.fingerprint == full.fingerprint
    with pytest.raises(qk.GgufError, match="header-only"):
        h.raw("token_embd.weight")
    with pytest.raises(qk.GgufError, match="header-only"):
        h.array("token_embd.weight")


def test_split_model(tmp_path) -> None:
    tensors = write_model(tmp_path / "s.gguf", split_max_tensors=2)
    shards = sorted(p.name for p in tmp_path.iterdir())
    assert shards == ["s-00001-of-00002.gguf", "s-00002-of-00002.gguf"]
    g = qk.Gguf(tmp_path / shards[0])
    assert len(g.shard_paths) == 2 and g.arch == "qwen35moe"
    assert g.metadata["split.count"] == 2
    assert len(g) == 4
    assert sorted({t.shard for t in g.tensors}) == [0, 1]
    for name, t in tensors.items():
        np.testing.assert_array_equal(g.array(name), t.astype(np.float32))
    h = qk.Gguf(tmp_path / shards[0], header_only=True)
    assert h.fingerprint == g.fingerprint and h.tensors == g.tensors
    with pytest.raises(qk.GgufError, match="first shard"):
        qk.Gguf(tmp_path / shards[1])
    (tmp_path / shards[1]).unlink()
    with pytest.raises(qk.GgufError, match="missing shard 2 of 2"):
        qk.Gguf(tmp_path / shards[0])


def test_unsupported_type_is_listed_and_raw_readable(tmp_path) -> None:
    # TQ2_0 (ternary models only): 66 bytes per 256 weights, not a type qk dequantises.
    w = gguf.GGUFWriter(str(tmp_path / "tq2.gguf"), "llama")
    x = np.random.default_rng(1).standard_normal((2, 256)).astype(np.float32)
    w.add_tensor("w", gguf.quants.quantize(x, Q.TQ2_0), raw_dtype=Q.TQ2_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = qk.Gguf(tmp_path / "tq2.gguf")
    t = g.tensor("w")
    assert (t.type, t.type_id, t.nbytes) == ("TQ2_0", 35, 132)
    assert g.raw("w").shape == (132,)
    with pytest.raises(qk.UnsupportedTypeError, match="TQ2_0"):
        g.array("w")
    assert issubclass(qk.UnsupportedTypeError, qk.GgufError)


def test_errors_are_typed_and_name_the_file(model, tmp_path) -> None:
    path, _ = model
    good = path.read_bytes()
    with pytest.raises(FileNotFoundError):
        qk.Gguf(tmp_path / "absent.gguf")
    cases = {
        "magic.gguf": (b"GGML" + good[4:], "not a GGUF file"),
        "empty.gguf": (b"", "truncated"),
        "version.gguf": (good[:4] + (99).to_bytes(4, "little") + good[8:], "version 99"),
        "count.gguf": (good[:16] + (2**63).to_bytes(8, "little") + good[24:], "absurd counts"),
        "cut.gguf": (good[: len(good) // 3], "truncated"),
    }
    for name, (data, fragment) in cases.items():
        bad = tmp_path / name
        bad.write_bytes(data)
        with pytest.raises(qk.GgufError, match=fragment) as err:
            qk.Gguf(bad)
        assert name in str(err.value)
        assert isinstance(err.value, qk.QkError)


def test_real_llama_cpp_vocab_files(sdist_root) -> None:
    """The vocabulary GGUFs shipped with llama.cpp (versions 2 and 3, written by its converters) all
    open; the smallest one's metadata equals what gguf-py's reader finds."""
    models = sdist_root / "vendor" / "llama.cpp" / "models"
    paths = sorted(models.glob("ggml-vocab-*.gguf"))
    assert len(paths) > 10
    versions = set()
    for path in paths:
        g = qk.Gguf(path)
        versions.add(g.version)
        m = g.metadata
        assert isinstance(g.arch, str) and g.arch
        assert len(m["tokenizer.ggml.tokens"]) > 1000, path.name
    assert versions == {2, 3}
    smallest = min(paths, key=lambda p: p.stat().st_size)
    ref = gguf.GGUFReader(smallest)
    expected = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert qk.Gguf(smallest).metadata == expected


INT_RANGES = {
    V.UINT8: (0, 2**8 - 1),
    V.INT8: (-(2**7), 2**7 - 1),
    V.UINT16: (0, 2**16 - 1),
    V.INT16: (-(2**15), 2**15 - 1),
    V.UINT32: (0, 2**32 - 1),
    V.INT32: (-(2**31), 2**31 - 1),
    V.UINT64: (0, 2**64 - 1),
    V.INT64: (-(2**63), 2**63 - 1),
}
SCALARS = {
    **{t: st.integers(lo, hi) for t, (lo, hi) in INT_RANGES.items()},
    V.FLOAT32: st.floats(width=32, allow_nan=False),
    V.FLOAT64: st.floats(allow_nan=False),
    V.BOOL: st.booleans(),
    V.STRING: st.text(max_size=12),
}
# Inner arrays of nested arrays: gguf-py infers their element type (int → i32, float → f32).
INFERRED = st.one_of(
    st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=4),
    st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=4),
    st.lists(st.text(max_size=5), min_size=1, max_size=4),
    st.lists(st.booleans(), min_size=1, max_size=4),
)


@st.composite
def typed_values(draw):
    """(value type, element type or None, value) as gguf-py's add_key_value takes them."""
    kind = draw(st.sampled_from(["scalar", "array", "nested"]))
    if kind == "scalar":
        t = draw(st.sampled_from(list(SCALARS)))
        return t, None, draw(SCALARS[t])
    if kind == "array":
        t = draw(st.sampled_from(list(SCALARS)))
        return V.ARRAY, t, draw(st.lists(SCALARS[t], min_size=1, max_size=6))
    inner = st.one_of(INFERRED, st.lists(INFERRED, min_size=1, max_size=3))
    return V.ARRAY, V.ARRAY, draw(st.lists(inner, min_size=1, max_size=4))


@settings(max_examples=40)
@given(
    st.dictionaries(
        st.text(min_size=1, max_size=16).filter(lambda k: not k.startswith("general.")),
        typed_values(),
        max_size=6,
    )
)
def test_metadata_round_trip(kv) -> None:
    """Whatever gguf-py writes, qk.Gguf reads back unchanged, in order."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.gguf")
        w = gguf.GGUFWriter(path, "qwen3next")
        for key, (vtype, sub_type, value) in kv.items():
            w.add_key_value(key, value, vtype, sub_type=sub_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        m = qk.Gguf(path).metadata
    assert list(m) == ["general.architecture", *kv]
    for key, (_, _, value) in kv.items():
        assert m[key] == value, key
        assert type(m[key]) is type(value), key
