"""Running llama.cpp (through llama-cpp-python) as the oracle, and the comparison rules of docs/numerics.md
"Near-tie certification" shared by the tests and the golden writer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

# A divergence from llama.cpp's greedy token is forgiven only where llama.cpp itself nearly tied:
# its top-2 logit gap below this, and the other side picked one of llama.cpp's top two.
NEAR_TIE = 0.15


def load(path: str | Path, n_ctx: int = 512):
    """A CPU llama.cpp context that returns logits for every position. K/V are kept in F32 (the default
    F16 cache would round them and blur the F32 comparison); flash attention off. One thread: the
    models are tiny, and ggml's spinning worker threads stall for ~0.8 s a step when the (2-core) CI
    machine is busy with anything else."""
    import llama_cpp

    return llama_cpp.Llama(
        str(path),
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=n_ctx,
        logits_all=True,
        verbose=False,
        type_k=0,
        type_v=0,
        flash_attn=False,
        n_threads=1,
        n_threads_batch=1,
        seed=0,
    )


def logits(llm, tokens: list[int]) -> np.ndarray:
    """Logits (n, vocab) of every position of `tokens`, evaluated from an empty context."""
    llm.reset()
    llm._ctx.kv_cache_clear()
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)], dtype=np.float64)


def top2_gap(row: np.ndarray) -> float:
    top = np.partition(row, -2)[-2:]
    return float(top[1] - top[0])


@dataclass
class Greedy:
    tokens: list[int]  # the continuation
    gaps: list[float]  # llama.cpp's top-2 gap at each step
    top2: list[tuple[int, int]]  # llama.cpp's two best ids at each step
    logits: np.ndarray  # (n_prompt + n − 1, vocab): teacher-forced logits along prompt + continuation


def greedy(llm, prompt: list[int], n: int) -> Greedy:
    """llama.cpp's greedy continuation. Evaluated as one batch over prompt + continuation after the
    tokens are known, so the logits along the path come from one pass."""
    llm.reset()
    llm._ctx.kv_cache_clear()
    llm.eval(prompt)
    out: list[int] = []
    for _ in range(n):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        tok = int(np.argmax(row))
        out.append(tok)
        llm.eval([tok])
    path = prompt + out
    lg = logits(llm, path[:-1])
    steps = lg[len(prompt) - 1 :]
    top2 = [tuple(int(i) for i in np.argsort(-r)[:2]) for r in steps]
    return Greedy(out, [top2_gap(r) for r in steps], top2, lg)


def nmse(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Normalised mean-squared error of each row of `a` against reference rows `b`."""
    return np.mean((a - b) ** 2, axis=-1) / np.mean(b * b, axis=-1)


def certified_prefix_match(ours: list[int], theirs: list[int], gaps: list[float], top2) -> tuple[bool, str]:
    """docs/numerics.md "Near-tie certification": the sequences are identical, or they first differ at a step where llama.cpp's
    top-2 gap < NEAR_TIE and our token is one of llama.cpp's top two (after which they may diverge)."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            if gaps[i] < NEAR_TIE and a in top2[i]:
                return True, f"near-tie at step {i} (gap {gaps[i]:.3f})"
            return False, f"step {i}: ours {a}, llama.cpp {b}, llama.cpp gap {gaps[i]:.3f}, top2 {top2[i]}"
    return True, "identical"


def teacher_forced(ours: np.ndarray, theirs: np.ndarray) -> dict:
    """Our argmax vs llama.cpp's at every position whose llama.cpp top-2 gap is ≥ NEAR_TIE."""
    gaps = np.array([top2_gap(r) for r in theirs])
    decisive = gaps >= NEAR_TIE
    agree = ours.argmax(-1) == theirs.argmax(-1)
    return {
        "positions": len(gaps),
        "decisive": int(decisive.sum()),
        "decisive_fraction": float(decisive.mean()),
        "disagree_decisive": int((~agree & decisive).sum()),
        "disagree_near_tie": int((~agree & ~decisive).sum()),
    }
