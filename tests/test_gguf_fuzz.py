"""Fuzzing the GGUF reader: thousands of mutated GGUF files (structure-aware field rewrites, byte
flips, truncations, insertions) are opened, their metadata converted and every tensor read raw and
dequantised, in a child process under an address-space cap (RLIMIT_AS) so that a huge allocation
aborts the child instead of exhausting the machine. Every file must either read or raise
``qk.GgufError``: no other exception, no crash, no hang.

Then hostile hyper-parameters: a tiny model of each architecture with one hyper-parameter rewritten
to an absurd value (2^31 heads, a 2^32−1 layer count, NaN epsilon…) is loaded as an engine, in a
child process (an abort must fail the test, not end the run). Each must load or raise
``qk.GgufError`` / ``qk.EngineError`` — never a Rust panic (``PanicException`` is a BaseException)
— and no load may allocate its way past a fixed bound."""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

FILES = 4000
SEED = 20261129
# Address space the child may add beyond what it holds after its imports. The valid files are a
# few KiB; 512 MiB is far more than reading them needs and far less than an absurd count would take.
HEADROOM = 512 << 20

INTERESTING_U64 = [0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 31, 32, 33, 64, 255, 256, 4096, 2**16, 2**31 - 1, 2**31]
INTERESTING_U64 += [2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 32, 2**64 - 1]
SUPPORTED = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"}
INTERESTING_U32 = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 20, 23, 24, 30, 31, 39, 99]
INTERESTING_U32 += [2**16, 2**31, 2**32 - 1]


def write_bases(tmp: Path) -> list[list[bytes]]:
    """Base models to mutate: one single file with every value type and tensor type, and a split
    model of two shards. Each entry lists a model's file contents in shard order."""
    import gguf
    import numpy as np
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(SEED)

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_block_count(4)
        w.add_uint32("qwen35moe.full_attention_interval", 4)
        w.add_float32("qwen35moe.rope.freq_base", 1e7)
        w.add_bool("t.bool", True)
        w.add_int64("t.i64", -5)
        w.add_float64("t.f64", 0.5)
        w.add_array("t.strs", ["a", "bb", "ccc"])
        w.add_array("t.nested", [[1, 2], [[3]], ["x"]])
        w.add_array("t.u8s", [1, 2, 3, 4])
        types = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.IQ4_NL, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.Q4_1]
        for i, q in enumerate(types):
            block_len, block_bytes = GGML_QUANT_SIZES[q]
            rows = 1 + i % 3
            raw = rng.integers(0, 256, size=(rows, block_bytes * max(1, 256 // block_len)), dtype=np.uint8)
            w.add_tensor(f"blk.{i % 4}.t{i}.weight", raw, raw_dtype=q)

    single = tmp / "base.gguf"
    for path, split in ((single, 0), (tmp / "split.gguf", 6)):
        w = gguf.GGUFWriter(str(path), "qwen35moe", split_max_tensors=split)
        fill(w)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    shards = sorted(tmp.glob("split-*.gguf"))
    assert len(shards) == 2, shards
    return [[single.read_bytes()], [p.read_bytes() for p in shards]]


def header_fields(data: bytes) -> list[tuple[int, int]]:
    """(offset, size) of every integer field of a valid GGUF header: version, counts, lengths,
    value types, array element types and counts, n_dims, dims, tensor types and offsets."""
    return header_layout(data)[0]


def metadata_values(data: bytes) -> dict[str, tuple[int, int]]:
    """Key → (value type, offset of the value) for every u32 and f32 metadata entry."""
    return header_layout(data)[1]


def header_layout(data: bytes) -> tuple[list[tuple[int, int]], dict[str, tuple[int, int]]]:
    """``header_fields`` and ``metadata_values`` of a valid GGUF header, in one walk."""
    fields = [(4, 4), (8, 8), (16, 8)]
    scalars: dict[str, tuple[int, int]] = {}
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string(pos: int) -> int:
        fields.append((pos, 8))
        return pos + 8 + struct.unpack_from("<Q", data, pos)[0]

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def value(pos: int, ty: int) -> int:
        if ty == 8:
            return string(pos)
        if ty == 9:
            fields.extend([(pos, 4), (pos + 4, 8)])
            elem, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            for _ in range(count):
                pos = value(pos, elem)
            return pos
        return pos + sizes[ty]

    for _ in range(n_kv):
        key_at = pos
        pos = string(pos)
        fields.append((pos, 4))
        ty = struct.unpack_from("<I", data, pos)[0]
        if ty in (4, 6):
            scalars[data[key_at + 8 : pos].decode()] = (ty, pos + 4)
        pos = value(pos + 4, ty)
    for _ in range(n_tensors):
        pos = string(pos)
        fields.append((pos, 4))
        n_dims = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        for _ in range(n_dims):
            fields.append((pos, 8))
            pos += 8
        fields.extend([(pos, 4), (pos + 4, 8)])
        pos += 12
    return fields, scalars


def mutate(data: bytes, fields: list[tuple[int, int]], rnd: random.Random) -> bytes:
    b = bytearray(data)
    header_end = max(off + size for off, size in fields)
    for _ in range(rnd.choice([1, 1, 1, 2, 3])):
        op = rnd.random()
        if op < 0.45:  # rewrite an integer field with an interesting value
            off, size = rnd.choice(fields)
            if off + size > len(b):
                continue
            old = int.from_bytes(b[off : off + size], "little")
            pool = INTERESTING_U64 if size == 8 else INTERESTING_U32
            v = rnd.choice([*pool, old + 1, max(old - 1, 0), old * 2, rnd.getrandbits(8 * size)])
            b[off : off + size] = (v % (1 << (8 * size))).to_bytes(size, "little")
        elif op < 0.70:  # flip bits, mostly in the header
            end = header_end if rnd.random() < 0.8 else len(b)
            for _ in range(rnd.randint(1, 4)):
                if end:
                    b[rnd.randrange(min(end, len(b)))] ^= 1 << rnd.randrange(8)
        elif op < 0.82:  # truncate
            del b[rnd.randrange(len(b) + 1) :]
        elif op < 0.92:  # insert or delete a few bytes inside the header
            at = rnd.randrange(min(header_end, len(b)) + 1)
            if rnd.random() < 0.5:
                b[at:at] = bytes(rnd.getrandbits(8) for _ in range(rnd.randint(1, 9)))
            else:
                del b[at : at + rnd.randint(1, 9)]
        else:  # append garbage
            b.extend(bytes(rnd.getrandbits(8) for _ in range(rnd.randint(1, 64))))
        if not b:
            break
    return bytes(b)


def exercise(path: Path, header_only: bool, qk) -> tuple[bool, int]:
    """Opens and reads everything; returns (opened, tensors read). qk.GgufError is the only
    exception allowed out of the reader."""
    try:
        g = qk.Gguf(path, header_only=header_only)
    except qk.GgufError:
        return False, 0
    read = 0
    _ = (g.metadata, g.fingerprint, g.arch, g.version, g.alignment, len(g), repr(g))
    for t in g.tensors:
        assert t.name in g and t.shape == tuple(reversed(t.ne))
        try:
            raw = g.raw(t.name)
            assert raw.size == t.nbytes
            arr = g.array(t.name)
            assert arr.shape == t.shape
            read += 1
        except qk.GgufError:
            # Only header-only data access and types qk does not dequantise may refuse here.
            assert header_only or t.type not in SUPPORTED, (
                f"{t.name} ({t.type}) refused in a file that opened"
            )
    del g
    return True, read


def fuzz_child(workdir: str, files: int) -> int:
    """Entry point of the child process."""
    import resource

    import qk

    tmp = Path(workdir)
    bases = write_bases(tmp)
    vm = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            vm = int(line.split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + HEADROOM, vm + HEADROOM))

    rnd = random.Random(SEED)
    fields = [[header_fields(shard) for shard in base] for base in bases]
    stats = {"files": 0, "opened": 0, "refused": 0, "tensors_read": 0}
    for i in range(files):
        which = 0 if rnd.random() < 0.8 else 1
        shards = list(bases[which])
        k = rnd.randrange(len(shards))
        shards[k] = mutate(shards[k], fields[which][k], rnd)
        d = tmp / f"case{i}"
        d.mkdir()
        names = (
            ["m.gguf"]
            if len(shards) == 1
            else [f"m-{j + 1:05d}-of-{len(shards):05d}.gguf" for j in range(len(shards))]
        )
        for name, content in zip(names, shards, strict=True):
            (d / name).write_bytes(content)
        try:
            opened, read = exercise(d / names[0], header_only=False, qk=qk)
            exercise(d / names[0], header_only=True, qk=qk)
        except BaseException:
            print(f"case {i} (model {which}, shard {k}) failed:", file=sys.stderr)
            traceback.print_exc()
            (tmp / "failing.gguf").write_bytes(shards[k])
            return 1
        for name in names:
            (d / name).unlink()
        d.rmdir()
        stats["files"] += 1
        stats["opened" if opened else "refused"] += 1
        stats["tensors_read"] += read
    print(json.dumps(stats))
    return 0


@pytest.mark.timeout(300)
def test_mutated_files_never_crash(tmp_path) -> None:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import test_gguf_fuzz as f; "
        "sys.exit(f.fuzz_child(sys.argv[2], int(sys.argv[3])))"
    )
    here = os.fspath(Path(__file__).parent)
    proc = subprocess.run(
        [sys.executable, "-c", code, here, os.fspath(tmp_path), str(FILES)],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
    )
    assert proc.returncode == 0, f"child exited {proc.returncode}\n{proc.stderr[-4000:]}"
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stats["files"] == FILES
    # The mutations must reach past the header checks: a fair share of files still open and have
    # their tensors read, and a fair share is refused.
    assert stats["opened"] > FILES // 10 and stats["refused"] > FILES // 10, stats
    assert stats["tensors_read"] > FILES, stats


# -- hostile hyper-parameters -----------------------------------------------------------------------

# The hyper-parameters qk reads (rust/model/config.rs); the others cannot reach the engine.
HPARAMS = {
    "block_count",
    "nextn_predict_layers",
    "embedding_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.layer_norm_rms_epsilon",
    "attention.scale",
    "rope.dimension_count",
    "rope.freq_base",
    "full_attention_interval",
    "expert_count",
    "expert_used_count",
    "expert_feed_forward_length",
    "expert_shared_feed_forward_length",
    "ssm.conv_kernel",
    "ssm.state_size",
    "ssm.group_count",
    "ssm.time_step_rank",
    "ssm.inner_size",
}
HOSTILE_U32 = [0, 1, 3, 2**16 + 1, 2**31 - 1, 2**31, 2**32 - 1]
HOSTILE_F32 = [0.0, -1.0, float("inf"), float("-inf"), float("nan"), 3e38]
# Peak resident memory a child may add while loading the hostile files: the tiny models need a few
# tens of MiB; the unbounded layer plan of a 2^31-layer file took 2 GiB.
HOSTILE_RSS = 768 << 20


def hostile_child(workdir: str) -> int:
    """Entry point of the child process: every (architecture, hyper-parameter, hostile value)."""
    import math
    import resource

    import qk
    from qk import testmodel

    tmp = Path(workdir)
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    stats = {"cases": 0, "loaded": 0, "refused": 0}
    for arch in ("qwen35moe", "qwen3next"):
        base = testmodel.write_model(tmp / f"{arch}.gguf", arch).read_bytes()
        for key, (ty, off) in metadata_values(base).items():
            if key.removeprefix(arch + ".") not in HPARAMS:
                continue
            fmt = "<I" if ty == 4 else "<f"
            (original,) = struct.unpack_from(fmt, base, off)
            for value in HOSTILE_U32 if ty == 4 else HOSTILE_F32:
                if value == original or (math.isnan(value) and math.isnan(original)):
                    continue
                data = bytearray(base)
                struct.pack_into(fmt, data, off, value)
                path = tmp / "case.gguf"
                path.write_bytes(data)
                case = f"{arch} {key} = {value} (was {original})"
                try:
                    engine = qk.Engine(str(path), slots=1, ctx=64)
                    del engine
                    stats["loaded"] += 1
                except (qk.GgufError, qk.EngineError):
                    stats["refused"] += 1
                except BaseException:
                    print(f"case {case} raised:", file=sys.stderr)
                    traceback.print_exc()
                    return 1
                grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start_rss
                if grown > HOSTILE_RSS:
                    print(f"case {case}: peak memory grew by {grown >> 20} MiB", file=sys.stderr)
                    return 1
                stats["cases"] += 1
    print(json.dumps(stats))
    return 0


@pytest.mark.timeout(300)
def test_hostile_hyperparameters_never_panic_or_exhaust_memory(tmp_path) -> None:
    from conftest import require_gpu

    qk = pytest.importorskip("qk")
    if not require_gpu() and not qk.adapters():
        pytest.skip("no GPU adapter: loading an engine needs one")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import test_gguf_fuzz as f; "
        "sys.exit(f.hostile_child(sys.argv[2]))"
    )
    here = os.fspath(Path(__file__).parent)
    proc = subprocess.run(
        [sys.executable, "-c", code, here, os.fspath(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
    )
    tail = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("qk: "))[-4000:]
    assert proc.returncode == 0, f"child exited {proc.returncode}\n{tail}"
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    # Every hyper-parameter of both architectures got its hostile values, and they were refused.
    assert stats["cases"] > 200 and stats["refused"] > stats["cases"] * 3 // 4, stats
