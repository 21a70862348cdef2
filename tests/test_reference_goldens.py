"""The committed goldens (llama.cpp's outputs on each committed fixture) against the NumPy reference —
no llama.cpp needed — and, where llama.cpp is installed, against a live llama.cpp run."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from reference import llama
from reference.model import Model

FIXTURES = Path(__file__).resolve().parent / "fixtures"
GOLDENS = sorted((FIXTURES / "goldens").glob("*.json"))

# Tolerances as in test_reference_llama.py (same reasons): F32 weights 1e-6, quantised 1e-3, both as
# normalised MSE over the golden's top-k logits of each position; positions after a routing near-tie
# (the last chosen expert's relative margin below ROUTE_TIE) only to AFTER_ROUTE_TIE.
F32_NMSE, QUANT_NMSE, AFTER_ROUTE_TIE = 1e-6, 1e-3, 5e-2
ROUTE_TIE_F32, ROUTE_TIE_QUANT = 1e-4, 1e-3
# Live llama.cpp vs its own golden: same code, but another CPU may take other SIMD paths (other
# summation orders, another activation-rounding flip): hold it to the reference tolerances.


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def is_quantised(golden: dict) -> bool:
    return not golden["header"]["fixture"].endswith("-f32.gguf")


def topk_matrix(rows: list[dict], logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(golden top-k logits, the same ids' logits from `logits`) as (n, k) arrays."""
    theirs = np.array([r["logits"] for r in rows])
    ours = np.stack([logits[i, r["ids"]] for i, r in enumerate(rows)])
    return ours, theirs


def test_goldens_exist_for_every_fixture():
    fixtures = sorted(p.stem for p in FIXTURES.glob("tiny-*.gguf"))
    assert fixtures and fixtures == [p.stem for p in GOLDENS]


@pytest.fixture(scope="module", params=GOLDENS, ids=lambda p: p.stem)
def case(request):
    golden = load(request.param)
    path = FIXTURES / golden["header"]["fixture"]
    return golden, path, Model(path, act_quant=is_quantised(golden))


def test_golden_is_of_this_fixture(case):
    golden, path, _ = case
    assert hashlib.sha256(path.read_bytes()).hexdigest() == golden["header"]["fixture_sha256"], (
        "fixture changed: rerun tests/reference/make_goldens.py"
    )
    assert golden["prompt_tokens"] == golden["prompt_text_tokens"][: len(golden["prompt_tokens"])]


def test_reference_matches_golden_logits(case):
    golden, _, ref = case
    ours_all = ref.forward(golden["prompt_tokens"])
    ours, theirs = topk_matrix(golden["prompt_topk"], ours_all)
    err = llama.nmse(ours, theirs)
    tie = np.flatnonzero(ref.route_margin < (ROUTE_TIE_QUANT if is_quantised(golden) else ROUTE_TIE_F32))
    first_tie = int(tie[0]) if len(tie) else len(err)
    print(golden["header"]["fixture"], "nmse max", err[:first_tie].max(), "route tie at", first_tie)
    assert first_tie >= 8
    assert err[:first_tie].max() <= (QUANT_NMSE if is_quantised(golden) else F32_NMSE)
    assert err.max() <= AFTER_ROUTE_TIE


def test_reference_follows_golden_greedy(case):
    """Teacher-forced along the golden path: our argmax is llama.cpp's wherever its gap is decisive;
    free-running: our greedy continuation matches up to a certified near-tie."""
    golden, _, ref = case
    prompt, g = golden["prompt_tokens"], golden["greedy"]
    tf = ref.forward(prompt + g["tokens"][:-1])[len(prompt) - 1 :]
    gaps = np.array(g["gaps"])
    decisive = gaps >= golden["header"]["near_tie"]
    agree = tf.argmax(-1) == np.array([t[0] for t in g["top2"]])
    assert decisive.mean() >= 0.8
    assert np.all(agree[decisive])
    st = ref.new_state()
    row = ref.forward(prompt, st)[-1]
    ours = []
    for _ in g["tokens"]:
        ours.append(int(np.argmax(row)))
        row = ref.forward([ours[-1]], st)[-1]
    ok, why = llama.certified_prefix_match(ours, g["tokens"], g["gaps"], [tuple(t) for t in g["top2"]])
    assert ok, why


@pytest.mark.oracle
def test_live_llama_cpp_matches_golden(case):
    pytest.importorskip("llama_cpp")
    golden, path, ref = case
    llm = llama.load(path)
    prompt = golden["prompt_tokens"]
    tokens = llm.tokenize(golden["prompt_text"].encode(), add_bos=False, special=True)
    assert tokens == golden["prompt_text_tokens"]
    live = llama.logits(llm, prompt)
    ours, theirs = topk_matrix(golden["prompt_topk"], live)
    assert llama.nmse(ours, theirs).max() <= (QUANT_NMSE if is_quantised(golden) else F32_NMSE)
    g = llama.greedy(llm, prompt, len(golden["greedy"]["tokens"]))
    gg = golden["greedy"]
    ok, why = llama.certified_prefix_match(g.tokens, gg["tokens"], gg["gaps"], [tuple(t) for t in gg["top2"]])
    assert ok, why
