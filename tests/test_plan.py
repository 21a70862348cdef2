"""``qk.plan``: memory formulas on hand-computed cases, the exact solver against brute force (fixed
and random problems), refusals with the shortfall per device, the printed launch commands, and a
full-size Qwen3-Next-80B header (tensor table only, no data)."""

from __future__ import annotations

import itertools
import math
import re

import gguf
import numpy as np
import pytest
import qk
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st
from qk import plan as qp

GIB = 1 << 30
BLOCK = {Q.IQ4_XS: (256, 136), Q.Q8_0: (32, 34), Q.F32: (1, 4)}

# The real model's shape (Qwen3-Next-80B-A3B, docs/numerics.md "Metadata") and a tiny one whose matrix rows
# are multiples of 256 so IQ4_XS blocks fit.
NEXT80B = dict(
    arch="qwen3next", E=2048, L=48, experts=512, used=10, ff=512, shff=512, heads=16, kv=2, hd=256, kh=16, vh=32,
    st=128, vocab=151936, mtp=0,
)  # fmt: skip
TINY = dict(
    arch="qwen3next", E=256, L=8, experts=4, used=2, ff=256, shff=256, heads=4, kv=2, hd=64, kh=2, vh=4, st=64,
    vocab=512, mtp=0,
)  # fmt: skip


def nbytes(ne, q) -> int:
    per, size = BLOCK[q]
    return math.prod(ne) // per * size


def tensor_plan(s: dict) -> list[tuple[str, tuple[int, ...], Q]]:
    """(name, ne, type) of every tensor, as benches/make_model.py writes them: IQ4_XS matrices, Q8_0
    embedding and LM head, F32 small tensors; layer i is full attention iff (i + 1) % 4 == 0."""
    E, key_dim, value_dim = s["E"], s["st"] * s["kh"], s["st"] * s["vh"]
    conv_dim = 2 * key_dim + value_dim
    out = [
        ("token_embd.weight", (E, s["vocab"]), Q.Q8_0),
        ("output_norm.weight", (E,), Q.F32),
        ("output.weight", (E, s["vocab"]), Q.Q8_0),
    ]
    n_blocks = s["L"] + s["mtp"]
    for i in range(n_blocks):
        p = f"blk.{i}."
        add = lambda n, ne, q, p=p: out.append((p + n, ne, q))  # noqa: E731
        add("attn_norm.weight", (E,), Q.F32)
        add("post_attention_norm.weight", (E,), Q.F32)
        if (i + 1) % 4 == 0 or i >= s["L"]:
            add("attn_q.weight", (E, 2 * s["hd"] * s["heads"]), Q.IQ4_XS)
            add("attn_k.weight", (E, s["hd"] * s["kv"]), Q.IQ4_XS)
            add("attn_v.weight", (E, s["hd"] * s["kv"]), Q.IQ4_XS)
            add("attn_output.weight", (s["hd"] * s["heads"], E), Q.IQ4_XS)
            add("attn_q_norm.weight", (s["hd"],), Q.F32)
            add("attn_k_norm.weight", (s["hd"],), Q.F32)
        else:
            add("attn_qkv.weight", (E, conv_dim), Q.IQ4_XS)
            add("attn_gate.weight", (E, value_dim), Q.IQ4_XS)
            add("ssm_conv1d.weight", (4, conv_dim), Q.F32)
            add("ssm_dt.bias", (s["vh"],), Q.F32)
            add("ssm_a", (s["vh"],), Q.F32)
            add("ssm_ba.weight", (E, 2 * s["vh"]), Q.F32)
            add("ssm_norm.weight", (s["st"],), Q.F32)
            add("ssm_out.weight", (value_dim, E), Q.IQ4_XS)
        add("ffn_gate_inp.weight", (E, s["experts"]), Q.F32)
        add("ffn_gate_exps.weight", (E, s["ff"], s["experts"]), Q.IQ4_XS)
        add("ffn_up_exps.weight", (E, s["ff"], s["experts"]), Q.IQ4_XS)
        add("ffn_down_exps.weight", (s["ff"], E, s["experts"]), Q.IQ4_XS)
        add("ffn_gate_inp_shexp.weight", (E,), Q.F32)
        add("ffn_gate_shexp.weight", (E, s["shff"]), Q.IQ4_XS)
        add("ffn_up_shexp.weight", (E, s["shff"]), Q.IQ4_XS)
        add("ffn_down_shexp.weight", (s["shff"], E), Q.IQ4_XS)
    return out


def write_model(path, s: dict, *, data: bool, drop=frozenset()) -> list[tuple[str, tuple[int, ...], Q]]:
    """A GGUF of shape ``s`` without the tensors named in ``drop``: header + tensor table, and random
    tensor bytes only if ``data``."""
    w = gguf.GGUFWriter(str(path), arch=s["arch"])
    w.add_context_length(262144)
    w.add_embedding_length(s["E"])
    w.add_block_count(s["L"] + s["mtp"])
    if s["mtp"]:
        w.add_uint32(f"{s['arch']}.nextn_predict_layers", s["mtp"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv"])
    w.add_key_length(s["hd"])
    w.add_value_length(s["hd"])
    w.add_expert_count(s["experts"])
    w.add_expert_used_count(s["used"])
    w.add_expert_feed_forward_length(s["ff"])
    w.add_expert_shared_feed_forward_length(s["shff"])
    w.add_ssm_conv_kernel(4)
    w.add_ssm_inner_size(s["st"] * s["vh"])
    w.add_ssm_state_size(s["st"])
    w.add_ssm_time_step_rank(s["vh"])
    w.add_ssm_group_count(s["kh"])
    w.add_full_attention_interval(4)
    tensors = [t for t in tensor_plan(s) if t[0] not in drop]
    for name, ne, q in tensors:
        shape = tuple(reversed(ne))
        per, size = BLOCK[q]
        if q == Q.F32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes(ne, q))
        else:
            w.add_tensor_info(
                name, (*shape[:-1], shape[-1] // per * size), np.dtype(np.uint8), nbytes(ne, q), raw_dtype=q
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    if data:
        rng = np.random.default_rng(0)
        for _name, ne, q in tensors:
            shape = tuple(reversed(ne))
            if q == Q.F32:
                w.write_tensor_data(rng.standard_normal(shape).astype(np.float32))
            else:
                per, size = BLOCK[q]
                raw = np.frombuffer(rng.bytes(nbytes(ne, q)), np.uint8)
                w.write_tensor_data(raw.reshape((*shape[:-1], shape[-1] // per * size)))
    w.close()
    return tensors


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "tiny.gguf"
    return path, write_model(path, TINY, data=True)


@pytest.fixture(scope="module")
def tiny_facts(tiny):
    return qp.ModelFacts.from_gguf(tiny[0])


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "next80b-header.gguf"
    return path, write_model(path, NEXT80B, data=False)


def layer_bytes(tensors, i: int) -> int:
    return sum(nbytes(ne, q) for n, ne, q in tensors if n.startswith(f"blk.{i}."))


# ---- brute force -------------------------------------------------------------------------------


def layouts(L: int, D: int):
    for cuts in itertools.combinations(range(1, L), D - 1):
        yield [0, *cuts, L]


def brute(p: qp.Problem):
    """(best bottleneck, smallest sum among the bottleneck-optimal) over every fitting layout, or
    None; and the smallest largest shortfall over every layout."""
    D, L = p.n_device, p.n_layer
    best = None
    least_worst = math.inf
    for b in layouts(L, D):
        over = [p.over(d, b[d], b[d + 1]) for d in range(D)]
        least_worst = min(least_worst, max(over))
        if max(over) == 0:
            times = [p.time(d, b[d], b[d + 1]) for d in range(D)]
            key = (max(times), sum(times))
            if (
                best is None
                or key[0] < best[0] * (1 - 1e-12)
                or (math.isclose(key[0], best[0]) and key[1] < best[1])
            ):
                best = key
    return best, least_worst


def check_against_brute(p: qp.Problem) -> None:
    best, least_worst = brute(p)
    if best is None:
        with pytest.raises(qp.PlanError) as e:
            qp.solve(p)
        short = e.value.shortfall_gib
        assert len(short) == p.n_device
        assert math.isclose(max(short.values()) * GIB, least_worst, rel_tol=1e-9)
        return
    b = qp.solve(p)
    assert b[0] == 0 and b[-1] == p.n_layer and all(x < y for x, y in zip(b, b[1:], strict=False))
    assert all(p.mem(d, b[d], b[d + 1]) <= p.capacity[d] for d in range(p.n_device))
    times = [p.time(d, b[d], b[d + 1]) for d in range(p.n_device)]
    assert math.isclose(max(times), best[0], rel_tol=1e-9)
    assert sum(times) <= best[1] * (1 + 1e-9)


# ---- memory formulas ---------------------------------------------------------------------------


def test_facts_of_the_tiny_model(tiny) -> None:
    path, tensors = tiny
    f = qp.ModelFacts.from_gguf(path)
    assert f.kinds == ("deltanet",) * 3 + ("attention",) + ("deltanet",) * 3 + ("attention",)
    assert f.layer_weight_bytes == tuple(layer_bytes(tensors, i) for i in range(8))
    assert f.head_weight_bytes == 512 * 256 // 32 * 34
    assert f.tail_weight_bytes == 256 * 4 + 512 * 256 // 32 * 34
    # conv: (K−1)·conv_dim·4 with conv_dim = 2·2·64 + 4·64 = 512; S: nv·dk·dv·4 = 4·64·64·4.
    assert (f.conv_state_bytes, f.ssm_state_bytes) == (3 * 512 * 4, 4 * 64 * 64 * 4)
    assert f.kv_elements_per_position == 2 * (64 + 64)
    # Bytes read per token: the routed experts count 2 of 4, everything else in full.
    exps = sum(nbytes(ne, q) for n, ne, q in tensors if n.startswith("blk.0.") and "_exps" in n)
    assert f.layer_read_bytes[0] == pytest.approx(layer_bytes(tensors, 0) - exps / 2)


def test_stage_memory_hand_computed(tiny) -> None:
    path, tensors = tiny
    f = qp.ModelFacts.from_gguf(path)
    sizing = qp.Sizing(ctx=1000, slots=3, kv_type="f32", snapshots=2, reserve_gib=0.25)
    m = qp.stage_memory(f, sizing, 2, 8)  # layers 2..7: DeltaNet 2, 4, 5, 6; attention 3, 7; last stage
    kv_slot_layer = 1000 * 2 * 2 * 64 * 4  # ctx · Hkv · (k + v head dims) · f32
    dn_slot_layer = 3 * 512 * 4 + 4 * 64 * 64 * 4
    assert m.kv == 3 * 2 * kv_slot_layer
    assert m.deltanet == 3 * 4 * dn_slot_layer
    assert m.snapshots == 2 * (2 * kv_slot_layer + 4 * dn_slot_layer)
    assert m.weights == sum(layer_bytes(tensors, i) for i in range(2, 8)) + 256 * 4 + 512 * 256 // 32 * 34
    assert m.reserve == GIB // 4
    rows = 64  # max(chunk 64, 3 slots)
    activation = (
        4 * 256
        + (2 * 512 + 2 * 4 + 3 * 256)
        + 4 * 4 * 64
        + 2 * 2 * 64
        + 4
        + 2 * 2
        + 3 * 2 * 256
        + 2 * 256
        + 3 * 256
        + 1
    )
    deltanet_chunk = 4 * 4 * 64 * (64 + 64 + 64)
    assert m.scratch == 4 * rows * activation + deltanet_chunk + 4 * rows * 512
    assert m.total == m.weights + m.kv + m.deltanet + m.snapshots + m.scratch + m.reserve
    # A middle stage has no embedding, no LM head, no logits; f16 KV halves the KV, q8_0 K + f16 V
    # takes 34/32 + 2 bytes per K/V element pair.
    mid = qp.stage_memory(f, qp.Sizing(ctx=1000, slots=3, kv_type="f16", snapshot_gib=1.5), 1, 4)
    assert mid.weights == sum(layer_bytes(tensors, i) for i in range(1, 4))
    assert mid.kv == 3 * kv_slot_layer // 2
    q8 = qp.stage_memory(f, qp.Sizing(ctx=1000, slots=3, kv_type="q8_0", snapshot_gib=1.5), 1, 4)
    assert q8.kv == 3 * 1000 * 2 * 64 * (34 / 32 + 2)
    assert mid.snapshots == 3 * GIB // 2
    assert mid.scratch == 4 * rows * activation + deltanet_chunk
    head = qp.stage_memory(f, sizing, 0, 1)
    assert head.weights == layer_bytes(tensors, 0) + 512 * 256 // 32 * 34


def test_additive_problem_matches_stage_memory(tiny) -> None:
    path, _ = tiny
    f = qp.ModelFacts.from_gguf(path)
    for sizing in (
        qp.Sizing(ctx=777, slots=2),
        qp.Sizing(ctx=64, slots=100, snapshot_gib=0.5, kv_type="q8_0"),
    ):
        costs = qp.Costs.from_bytes(f)
        p = qp._problem(f, sizing, costs, [qp.Device("a", 1.0, 2.0)])
        for a in range(8):
            for b in range(a + 1, 9):
                assert p.mem(0, a, b) == qp.stage_memory(f, sizing, a, b).total
                assert p.time(0, a, b) == pytest.approx(qp.stage_cost(f, costs, a, b) / 2.0)


def test_tied_lm_head_is_held_once_by_a_single_stage(tmp_path) -> None:
    path = tmp_path / "tied.gguf"
    tensors = write_model(path, TINY, data=False, drop={"output.weight"})
    f = qp.ModelFacts.from_gguf(path)
    embd = 512 * 256 // 32 * 34
    assert f.tied_lm_head and f.tail_weight_bytes == 256 * 4 + embd
    sizing = qp.Sizing(ctx=64, slots=1)
    layers = sum(layer_bytes(tensors, i) for i in range(8))
    assert qp.stage_memory(f, sizing, 0, 8).weights == layers + 256 * 4 + embd
    assert (
        qp.stage_memory(f, sizing, 0, 4).weights + qp.stage_memory(f, sizing, 4, 8).weights
        == layers + 256 * 4 + 2 * embd
    )
    p = qp._problem(f, sizing, qp.Costs.from_bytes(f), [qp.Device("a", 1.0)])
    assert p.mem(0, 0, 8) == qp.stage_memory(f, sizing, 0, 8).total


def test_non_hybrid_model_is_refused(tmp_path) -> None:
    path = tmp_path / "llama.gguf"
    write_model(path, dict(TINY, arch="llama"), data=False)
    with pytest.raises(qp.PlanError, match="not a hybrid"):
        qp.ModelFacts.from_gguf(path)


def test_bad_metadata_is_a_plan_error(tmp_path, capsys) -> None:
    path = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(path), arch="qwen3next")
    w.add_block_count(4)
    w.add_full_attention_interval(0)
    w.add_tensor_info("token_embd.weight", (8, 4), np.dtype(np.float32), 128)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with pytest.raises(qp.PlanError, match="unusable metadata: .*full_attention_interval"):
        qp.ModelFacts.from_gguf(path)
    assert qp.main([str(path), "--device", "a:8", "--ctx", "64", "--slots", "1"]) == 2
    assert qp.main([str(tmp_path / "missing.gguf"), "--device", "a:8", "--ctx", "64", "--slots", "1"]) == 2
    assert "unusable metadata" in capsys.readouterr().err


def test_mtp_layers_are_not_planned(tmp_path) -> None:
    s = dict(TINY, arch="qwen35moe", L=4, mtp=1)
    path = tmp_path / "mtp.gguf"
    tensors = write_model(path, s, data=False)
    f = qp.ModelFacts.from_gguf(path)
    assert (f.n_layer, f.n_mtp) == (4, 1)
    assert sum(f.layer_weight_bytes) == sum(layer_bytes(tensors, i) for i in range(4))


# ---- the solver --------------------------------------------------------------------------------


def test_solver_matches_brute_force_on_the_tiny_model(tiny) -> None:
    path, _ = tiny
    f = qp.ModelFacts.from_gguf(path)
    sizing = qp.Sizing(ctx=4096, slots=2, reserve_gib=0)
    need = qp.stage_memory(f, sizing, 0, 8).total
    for devs in (
        [qp.Device("a", need / GIB), qp.Device("b", need / GIB, 3.0)],
        [
            qp.Device("a", 0.4 * need / GIB, 2.0),
            qp.Device("b", need / GIB),
            qp.Device("c", 0.5 * need / GIB, 0.5),
        ],
        [
            qp.Device("a", 0.3 * need / GIB),
            qp.Device("b", 0.3 * need / GIB),
            qp.Device("c", 0.3 * need / GIB),
        ],
    ):
        check_against_brute(qp._problem(f, sizing, qp.Costs.from_bytes(f), devs))


@settings(max_examples=300)
@given(data=st.data())
def test_solver_matches_brute_force_on_random_problems(data) -> None:
    L = data.draw(st.integers(1, 9), label="layers")
    D = data.draw(st.integers(1, min(L, 4)), label="devices")
    costs = data.draw(st.lists(st.floats(0, 100, allow_subnormal=False), min_size=L, max_size=L))
    mems = data.draw(st.lists(st.integers(0, 50), min_size=L, max_size=L))
    p = qp.Problem(
        layer_cost=costs,
        layer_mem=mems,
        head_cost=data.draw(st.floats(0, 50, allow_subnormal=False)),
        head_mem=data.draw(st.integers(0, 80)),
        tail_cost=data.draw(st.floats(0, 50, allow_subnormal=False)),
        tail_mem=data.draw(st.integers(0, 80)),
        capacity=data.draw(st.lists(st.integers(0, 300), min_size=D, max_size=D)),
        fixed_mem=data.draw(st.lists(st.integers(0, 20), min_size=D, max_size=D)),
        speed=data.draw(st.lists(st.floats(0.1, 10), min_size=D, max_size=D)),
        shared_end_mem=data.draw(st.integers(0, 20)),
    )
    check_against_brute(p)


@settings(max_examples=60)
@given(data=st.data())
def test_plan_on_a_model_matches_brute_force_over_stage_memory(tiny_facts, data) -> None:
    """End to end through ``plan``, against a brute force built on ``stage_memory``/``stage_cost``
    directly (not on the solver's additive form)."""
    f = tiny_facts
    D = data.draw(st.integers(1, 4), label="devices")
    # Capacities of a few MiB against this model's 2–3 MiB scratch and ~0.7 MiB layers: about 40%
    # of the draws fit somewhere, the rest exercise the refusal.
    mib = data.draw(st.lists(st.floats(2.5, 8), min_size=D, max_size=D), label="MiB")
    speeds = data.draw(st.lists(st.floats(0.2, 5), min_size=D, max_size=D), label="speeds")
    devs = [qp.Device(f"d{i}", m / 1024, v) for i, (m, v) in enumerate(zip(mib, speeds, strict=True))]
    sizing = dict(
        ctx=data.draw(st.integers(1, 1000), label="ctx"),
        slots=data.draw(st.integers(1, 2), label="slots"),
        snapshots=data.draw(st.integers(0, 1), label="snapshots"),
        reserve_gib=0,
    )
    costs = qp.Costs.from_bytes(f)
    best = None
    for b in layouts(8, D):
        stages = [(devs[d], b[d], b[d + 1]) for d in range(D)]
        if all(qp.stage_memory(f, qp.Sizing(**sizing), a, e).total <= dev.mem_bytes for dev, a, e in stages):
            t = max(qp.stage_cost(f, costs, a, e) / dev.speed for dev, a, e in stages)
            best = t if best is None else min(best, t)
    if best is None:
        with pytest.raises(qp.PlanError, match="no layout fits"):
            qp.plan(f, devs, **sizing)
        return
    r = qp.plan(f, devs, **sizing)
    assert math.isclose(r.bottleneck, best, rel_tol=1e-9)
    assert all(s.memory.total <= s.device.mem_bytes for s in r.stages)
    assert [s.first for s in r.stages] + [8] == [0] + [s.end for s in r.stages]


def test_more_devices_than_layers_is_refused() -> None:
    p = qp.Problem([1.0, 1.0], [1, 1], 0, 0, 0, 0, [10] * 3, [0] * 3, [1.0] * 3)
    with pytest.raises(qp.PlanError, match="3 devices but only 2 layers"):
        qp.solve(p)


# ---- the full-size 80B header ------------------------------------------------------------------


def test_full_size_header(big) -> None:
    path, tensors = big
    g = qk.Gguf(path, header_only=True)
    assert g.header_only and len(g) == len(tensors)
    f = qp.ModelFacts.from_model(g)
    assert f.n_layer == 48 and f.kinds.count("attention") == 12 and f.vocab == 151936
    assert f.layer_weight_bytes == tuple(layer_bytes(tensors, i) for i in range(48))
    total = sum(f.layer_weight_bytes) + f.head_weight_bytes + f.tail_weight_bytes
    assert total == sum(nbytes(ne, q) for _, ne, q in tensors)
    assert 42e9 < total < 44e9  # the real IQ4_XS repack is 42.8 GB
    # Per slot at ctx 32768: 64 MiB of f16 KV per attention layer (the engine's default cache);
    # 2 MiB S + 96 KiB conv per DeltaNet layer.
    state = qp.layer_state_bytes(f, qp.Sizing(ctx=32768, slots=1))
    assert state[3] == 32768 * 2 * 2 * 256 * 2 == 64 << 20
    assert state[0] == 2 << 20 | 3 * 8192 * 4

    result = qp.plan(f, ["tron:20", "midnight:48:0.6"], ctx=32768, slots=2)
    s0, s1 = result.stages
    assert (s0.first, s0.end, s1.first, s1.end) == (0, s0.end, s0.end, 48)
    assert all(st.memory.total <= st.device.mem_bytes for st in result.stages)
    p = qp._problem(f, result.sizing, result.costs, [s0.device, s1.device])
    check_against_brute(p)
    assert math.isclose(result.bottleneck, qp.bottleneck(p, [0, s0.end, 48]))
    # Equal speeds and ample memory: the last stage also reads the LM head (Q8_0, 2048 × 151936 ≈ 8
    # layers' worth of reads per token), so the head takes more than half of the layers, and the two
    # stage times differ by less than one layer's cost.
    even = qp.plan(f, ["a:80", "b:80"], ctx=4096, slots=1)
    assert even.stages[0].end > 24
    assert abs(even.stages[0].time - even.stages[1].time) <= max(f.layer_read_bytes)


def test_full_size_refusal_names_the_shortfall(big) -> None:
    path, _ = big
    f = qp.ModelFacts.from_gguf(path)
    with pytest.raises(qp.PlanError) as e:
        qp.plan(f, ["tron:16", "midnight:16"], ctx=32768, slots=2)
    msg = str(e.value)
    assert "no layout fits" in msg and "tron: short by" in msg and "midnight: short by" in msg
    short = e.value.shortfall_gib
    assert set(short) == {"tron", "midnight"} and all(v > 0 for v in short.values())
    # The closest layout is short by what a brute force over all 47 boundaries finds.
    sizing = qp.Sizing(ctx=32768, slots=2)
    p = qp._problem(f, sizing, qp.Costs.from_bytes(f), [qp.Device("tron", 16), qp.Device("midnight", 16)])
    _, least_worst = brute(p)
    assert math.isclose(max(short.values()), least_worst / GIB, rel_tol=1e-9)
    # Total need exceeds 32 GiB, so the shortfalls add up to at least the difference.
    need = sum(qp.stage_memory(f, sizing, *r).total for r in ((0, 24), (24, 48)))
    assert sum(short.values()) >= (need - 32 * GIB) / GIB - 1e-9


def test_same_name_twice_is_told_apart_in_the_refusal(big) -> None:
    path, _ = big
    with pytest.raises(qp.PlanError) as e:
        qp.plan(path, ["box@0:8", "box@1:8"], ctx=1024, slots=1)
    assert set(e.value.shortfall_gib) == {"box@0", "box@1"}


# ---- commands and the command line -------------------------------------------------------------


def test_launch_commands(tiny) -> None:
    path, _ = tiny
    f = qp.ModelFacts.from_gguf(path)
    r = qp.plan(f, ["head:4", "mid@1:4:2", "tail:4"], ctx=2048, slots=3, base_port=19000)
    a, b = r.stages[0].end, r.stages[1].end
    model = str(path)
    assert r.commands == [
        f"python -m qk.serve --model {model} --layers 0:{a} --split-next mid:19000 --slots 3 --ctx 2048 "
        '--secret "$QK_SECRET"',
        f"python -m qk.worker --model {model} --layers {a}:{b} --host 0.0.0.0 --port 19000 --next tail:19001 "
        '--slots 3 --ctx 2048 --device 1 --secret "$QK_SECRET"',
        f"python -m qk.worker --model {model} --layers {b}:8 --host 0.0.0.0 --port 19001 --slots 3 --ctx 2048 "
        '--secret "$QK_SECRET"',
    ]
    single = qp.plan(f, ["solo:4"], ctx=2048, slots=1)
    assert single.commands == [f"python -m qk.serve --model {model} --slots 1 --ctx 2048"]
    assert (single.stages[0].first, single.stages[0].end, single.stages[0].share) == (0, 8, 1.0)


def test_main_prints_plan_and_commands(big, capsys) -> None:
    path, _ = big
    rc = qp.main(
        [str(path), "--device", "tron:20", "--device", "midnight:48:0.6", "--ctx", "32768", "--slots", "2"]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "KV f16" in out and "memory per device" in out and "python -m qk.worker" in out
    assert "--split-next midnight:18100" in out and "--port 18100" in out
    lines = [line for line in out.splitlines() if line.startswith(("head ", "w1 "))]
    shares = [float(re.search(r"([\d.]+)%", line).group(1)) for line in lines]
    assert len(shares) == 2 and abs(sum(shares) - 100) < 0.2
    # tron's 20 GiB hold fewer layers than its speed deserves: the plan says memory sets the split.
    assert re.search(r"memory-bound: .* more memory on tron \([\d.]+ GiB free\) would let it", out)
    assert qp.main([str(path), "--device", "a:80", "--device", "b:80", "--ctx", "4096", "--slots", "1"]) == 0
    assert "memory-bound" not in capsys.readouterr().out


def test_main_refusal_exit_code(big, capsys) -> None:
    path, _ = big
    rc = qp.main([str(path), "--device", "a:10", "--device", "b:10", "--ctx", "32768", "--slots", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "a: short by" in err and "b: short by" in err


@pytest.mark.parametrize("spec", ["nomem", "a:", "a:x", "a:-1", "a:4:0", ":4", "a:4:1:9", "a b:4", "a:nan"])
def test_bad_device_specs(spec) -> None:
    with pytest.raises(qp.PlanError):
        qp.Device.parse(spec)


def test_device_spec() -> None:
    assert qp.Device.parse("box@2:24.5:1.5") == qp.Device("box", 24.5, 1.5, "2")
    assert qp.Device.parse("10.0.0.7:8").mem_bytes == 8 * GIB


# ---- measured costs ----------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_measure_costs_with_a_fake_engine(tiny) -> None:
    path, _ = tiny
    f = qp.ModelFacts.from_gguf(path)
    clock = FakeClock()
    per_token = {"deltanet": 0.003, "attention": 0.005}
    made = []

    class Engine:
        def __init__(self, p, layers, slots, ctx) -> None:
            made.append((p, layers, slots, ctx))
            self.layers = layers

        def stage_run(self, slot, inputs, base) -> None:
            a, b = self.layers
            assert isinstance(inputs, list) if a == 0 else inputs.shape == (1, 256)
            clock.now += (
                sum(per_token[k] for k in f.kinds[a:b]) + (0.001 if a == 0 else 0) + (0.002 if b == 8 else 0)
            )

    costs = qp.measure_costs(path, f, tokens=4, engine_factory=Engine, clock=clock)
    assert [m[1] for m in made] == [(3, 4), (1, 2), (0, 1), (7, 8)]
    assert costs.unit == "s"
    assert costs.layer == pytest.approx([per_token[k] for k in f.kinds])
    assert (costs.head, costs.tail) == (pytest.approx(0.001), pytest.approx(0.002))
    r = qp.plan(f, ["a:4", "b:4"], ctx=256, slots=1, costs=costs)
    assert "ms bottleneck" in qp.format_plan(r)


def test_measure_without_an_engine_says_so(tiny, monkeypatch) -> None:
    import qk._qk

    monkeypatch.delattr(qk._qk, "Engine", raising=False)
    monkeypatch.delattr(qk, "Engine", raising=False)
    with pytest.raises(qp.PlanError, match="needs qk.Engine"):
        qp.find_engine()


@pytest.mark.gpu
def test_measure_on_the_real_engine_times_every_kind(capsys) -> None:
    """``--measure`` with the native engine on this machine's adapter (lavapipe in CI): every layer
    gets a positive time and the printed plan is in measured milliseconds."""
    from pathlib import Path

    from conftest import require_gpu

    qk_native = pytest.importorskip("qk._qk")
    fixture = Path(__file__).resolve().parent / "fixtures" / "tiny-qwen3next-f32.gguf"
    try:
        qk_native.Engine(str(fixture), layers=(0, 1), slots=1, ctx=8)
    except qk_native.DeviceError:
        if require_gpu():
            raise
        pytest.skip("no wgpu adapter")
    assert (
        qp.main(
            [str(fixture), "--device", "a:1", "--device", "b:1", "--ctx", "64", "--slots", "1", "--measure"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "measured seconds per token on this adapter" in out and "--split-next" in out
    f = qp.ModelFacts.from_gguf(fixture)
    costs = qp.measure_costs(fixture, f, tokens=2)
    assert costs.unit == "s" and all(c > 0 for c in costs.layer) and len(costs.layer) == f.n_layer
