"""Sampler: SplitMix64 reference values, each strategy on hand-computed logits, the temperature
policy, determinism and NaN rejection."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from qk.sampler import (
    Sampler,
    SamplerError,
    SamplingParams,
    SplitMix64,
    probabilities,
    resolve_temperature,
)


def test_splitmix64_reference_values():
    # First outputs for seed 0 and seed 1234567 from the reference C implementation
    # (Vigna's splitmix64.c, as listed in many test suites).
    rng = SplitMix64(0)
    assert [rng.next_u64() for _ in range(3)] == [
        0xE220A8397B1DCDAF,
        0x6E789E6AA1B965F4,
        0x06C45D188009454F,
    ]
    rng = SplitMix64(1234567)
    assert [rng.next_u64() for _ in range(2)] == [6457827717110365317, 3203168211198807973]


def test_next_float_in_unit_interval():
    rng = SplitMix64(42)
    values = [rng.next_float() for _ in range(2000)]
    assert all(0.0 <= v < 1.0 for v in values)
    # 2000 uniform draws: the mean is 0.5 ± 0.0065 (1 sigma); 5 sigma bound.
    assert abs(sum(values) / len(values) - 0.5) < 0.033


def ranked(pairs):
    return sorted(pairs, key=lambda c: (-c[1], c[0]))


def test_softmax_at_temperature_hand_computed():
    # logits 2, 1, 0 at T=1: e^0, e^-1, e^-2 over their sum.
    dist = probabilities(ranked([(7, 1.0), (3, 2.0), (9, 0.0)]), SamplingParams(temperature=1.0))
    z = 1 + math.exp(-1) + math.exp(-2)
    assert [i for i, _ in dist] == [3, 7, 9]
    assert [p for _, p in dist] == pytest.approx([1 / z, math.exp(-1) / z, math.exp(-2) / z], rel=1e-12)
    # T=0.5 doubles the gaps.
    dist = probabilities(ranked([(7, 1.0), (3, 2.0), (9, 0.0)]), SamplingParams(temperature=0.5))
    z = 1 + math.exp(-2) + math.exp(-4)
    assert dist[1][1] == pytest.approx(math.exp(-2) / z, rel=1e-12)


def test_top_k_and_top_p_cuts_hand_computed():
    pairs = ranked([(0, math.log(0.5)), (1, math.log(0.3)), (2, math.log(0.15)), (3, math.log(0.05))])
    # top_k=2 keeps 0.5 and 0.3 → 0.625, 0.375.
    dist = probabilities(pairs, SamplingParams(temperature=1.0, top_k=2))
    assert [p for _, p in dist] == pytest.approx([0.625, 0.375], rel=1e-12)
    # top_p=0.79: 0.5 falls short, 0.5+0.3 reaches it → the same two.
    dist = probabilities(pairs, SamplingParams(temperature=1.0, top_p=0.79))
    assert [i for i, _ in dist] == [0, 1]
    # top_p=0.81 needs the third.
    dist = probabilities(pairs, SamplingParams(temperature=1.0, top_p=0.81))
    assert [p for _, p in dist] == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95], rel=1e-12)
    # A tiny top_p still keeps the best candidate.
    assert [i for i, _ in probabilities(pairs, SamplingParams(temperature=1.0, top_p=1e-9))] == [0]


def test_pick_follows_the_uniform_draw():
    pairs = [(0, math.log(0.5)), (1, math.log(0.3)), (2, math.log(0.2))]
    params = SamplingParams(temperature=1.0, seed=99)
    draws = SplitMix64(99)
    sampler = Sampler(params)
    for _ in range(50):
        u = draws.next_float()
        expected = 0 if u < 0.5 else (1 if u < 0.8 else 2)
        assert sampler.pick(0, pairs) == expected


def test_ties_go_to_lowest_id():
    pairs = [(9, 1.0), (4, 1.0), (6, 1.0)]
    dist = probabilities(ranked(pairs), SamplingParams(temperature=1.0, top_k=1))
    assert dist == [(4, 1.0)]


def test_greedy_returns_engine_greedy_id():
    sampler = Sampler(SamplingParams(temperature=0.0, seed=5))
    assert sampler.pick(17, [(3, 9.0), (17, 1.0)]) == 17
    assert sampler.pick(17, None) == 17
    assert SamplingParams(temperature=0.0).candidates_needed == 0
    assert SamplingParams(temperature=0.7, top_k=40).candidates_needed == 40
    assert SamplingParams(temperature=0.7, top_k=0).candidates_needed == 256


def test_nan_raises():
    with pytest.raises(SamplerError, match="NaN"):
        Sampler(SamplingParams(temperature=1.0)).pick(0, [(0, 1.0), (1, float("nan"))])


def test_all_minus_inf_raises():
    with pytest.raises(SamplerError):
        Sampler(SamplingParams(temperature=1.0)).pick(0, [(0, -math.inf), (1, -math.inf)])


@given(
    st.lists(st.floats(-50, 50), min_size=1, max_size=40),
    st.integers(0, 2**64 - 1),
    st.floats(0.05, 3.0),
    st.floats(0.05, 1.0),
)
def test_same_seed_same_sequence(logits, seed, temperature, top_p):
    pairs = list(enumerate(logits))
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
    a, b = Sampler(params), Sampler(params)
    seq_a = [a.pick(0, pairs) for _ in range(20)]
    assert seq_a == [b.pick(0, pairs) for _ in range(20)]
    assert all(0 <= t < len(logits) for t in seq_a)


def test_temperature_policy():
    assert resolve_temperature(None, {}) == 0.0
    assert resolve_temperature(None, {"QK_TEMP_DEFAULT": "0.6"}) == 0.6
    assert resolve_temperature(0.0, {"QK_TEMP_DEFAULT": "0.6"}) == 0.0
    assert resolve_temperature(1.5, {"QK_TEMP_CAP": "1.0"}) == 1.0
    assert resolve_temperature(0.3, {"QK_TEMP_CAP": "1.0"}) == 0.3
    # The cap applies to explicit requests; the default is the operator's own choice.
    assert resolve_temperature(None, {"QK_TEMP_DEFAULT": "0.8", "QK_TEMP_CAP": "0.5"}) == 0.8
