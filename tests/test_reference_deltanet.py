"""The NumPy reference against itself: chunked (WY, chunk 64) vs recurrent gated delta rule, call
splitting, and prefill-then-decode vs one pass through a whole model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference.model import CHUNK, Model, delta_rule_chunked, delta_rule_recurrent, l2_norm

FIXTURES = Path(__file__).resolve().parent / "fixtures"

# f64 reference vs f64 reference: the chunked form reorders sums and inverts (I + A) per chunk, so the
# two agree to rounding (~1e-14 relative); 1e-10 leaves room without hiding a real formula error,
# which shows up at 1e-2 or worse.
SELF_TOL = 1e-10


def random_inputs(n: int, seed: int, heads: int = 3, dk: int = 16, dv: int = 24):
    rng = np.random.default_rng(seed)
    q = l2_norm(rng.standard_normal((n, heads, dk)), 1e-6) / np.sqrt(dk)
    k = l2_norm(rng.standard_normal((n, heads, dk)), 1e-6)
    v = rng.standard_normal((n, heads, dv))
    beta = 1 / (1 + np.exp(-rng.standard_normal((n, heads))))
    # Log-decays from ~0 (state kept across many chunks) to strongly negative (state forgotten).
    g = -np.exp(rng.uniform(-6, 1, (n, heads)))
    S0 = rng.standard_normal((heads, dk, dv)) * 0.3
    return q, k, v, beta, g, S0


def rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


@pytest.mark.parametrize("n", [1, 2, 17, 63, 64, 65, 127, 128, 129, 200, 300])
@pytest.mark.parametrize("pos0", [0, 5, 63])
def test_chunked_equals_recurrent(n, pos0):
    q, k, v, beta, g, S0 = random_inputs(n, seed=n * 1000 + pos0)
    o_r, S_r = delta_rule_recurrent(q, k, v, beta, g, S0)
    o_c, S_c = delta_rule_chunked(q, k, v, beta, g, S0, pos0=pos0)
    assert rel(o_c, o_r) < SELF_TOL
    assert rel(S_c, S_r) < SELF_TOL


@settings(max_examples=25)
@given(n=st.integers(1, 300), pos0=st.integers(0, 200), seed=st.integers(0, 2**32 - 1))
def test_chunked_equals_recurrent_anywhere(n, pos0, seed):
    q, k, v, beta, g, S0 = random_inputs(n, seed=seed, heads=2, dk=8, dv=8)
    o_r, S_r = delta_rule_recurrent(q, k, v, beta, g, S0)
    o_c, S_c = delta_rule_chunked(q, k, v, beta, g, S0, pos0=pos0)
    assert rel(o_c, o_r) < SELF_TOL
    assert rel(S_c, S_r) < SELF_TOL


def test_recurrent_matches_spec_formula_on_one_step():
    """One token by hand: S ← e^g S; δ = β(v − Sᵀk); S ← S + kδᵀ; o = Sᵀq (docs/numerics.md "Gated DeltaNet")."""
    q, k, v, beta, g, S0 = random_inputs(1, seed=3, heads=1, dk=4, dv=3)
    S = np.exp(g[0, 0]) * S0[0]
    delta = beta[0, 0] * (v[0, 0] - S.T @ k[0, 0])
    S = S + np.outer(k[0, 0], delta)
    o, S_out = delta_rule_recurrent(q, k, v, beta, g, S0)
    np.testing.assert_allclose(S_out[0], S, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(o[0, 0], S.T @ q[0, 0], rtol=1e-14, atol=1e-14)


def test_chunked_splits_at_chunk_multiples_are_bitwise_identical():
    """Chunk boundaries sit at absolute multiples of 64, so cutting a sequence into calls at multiples
    of 64 repeats exactly the same arithmetic (docs/numerics.md "Chunk alignment")."""
    n = 3 * CHUNK + 20
    q, k, v, beta, g, S0 = random_inputs(n, seed=11)
    o_all, S_all = delta_rule_chunked(q, k, v, beta, g, S0)
    S = S0
    parts = []
    for a, b in [(0, CHUNK), (CHUNK, 3 * CHUNK), (3 * CHUNK, n)]:
        o, S = delta_rule_chunked(q[a:b], k[a:b], v[a:b], beta[a:b], g[a:b], S, pos0=a)
        parts.append(o)
    assert np.array_equal(np.concatenate(parts), o_all)
    assert np.array_equal(S, S_all)


@pytest.fixture(scope="module", params=["qwen3next", "qwen35moe"])
def small_model(request) -> Model:
    return Model(FIXTURES / f"tiny-{request.param}-f32.gguf")


def test_model_chunked_equals_recurrent(small_model):
    tokens = np.random.default_rng(1).integers(0, small_model.vocab_size, 150)
    a = small_model.forward(tokens, chunked=True)
    b = small_model.forward(tokens, chunked=False)
    assert rel(a, b) < SELF_TOL


@pytest.mark.parametrize("cut", [1, 37, 64, 130])
def test_prefill_then_decode_equals_one_pass(small_model, cut):
    tokens = np.random.default_rng(cut).integers(0, small_model.vocab_size, 140)
    whole = small_model.forward(tokens)
    st = small_model.new_state()
    rows = [small_model.forward(tokens[:cut], st)]
    for t in tokens[cut:]:
        rows.append(small_model.forward([t], st, chunked=False))
    assert st.pos == len(tokens)
    assert rel(np.concatenate(rows), whole) < SELF_TOL


def test_state_snapshot_restores(small_model):
    rng = np.random.default_rng(5)
    a, b = rng.integers(0, small_model.vocab_size, 64), rng.integers(0, small_model.vocab_size, 10)
    st = small_model.new_state()
    small_model.forward(a, st)
    snap = st.copy()
    first = small_model.forward(b, st)
    again = small_model.forward(b, snap)
    assert np.array_equal(first, again)


def test_layer_ranges_compose(small_model):
    """Stages owning layers [0, a) and [a, n) with their own states give the whole model's logits."""
    tokens = np.random.default_rng(9).integers(0, small_model.vocab_size, 70)
    whole = small_model.forward(tokens)
    a = 2
    first, second = small_model.new_state(), small_model.new_state()
    x = small_model.run_layers(small_model.embed(tokens[:64]), first, 0, a)
    top = [small_model.head(small_model.run_layers(x, second, a))]
    for t in tokens[64:]:
        x = small_model.run_layers(small_model.embed([t]), first, 0, a)
        top.append(small_model.head(small_model.run_layers(x, second, a)))
    assert first.pos == second.pos == len(tokens)
    assert rel(np.concatenate(top), whole) < SELF_TOL
