#!/usr/bin/env python3
"""Writes tests/fixtures/goldens/<fixture>.json from llama.cpp's outputs on each committed fixture: the
prompt (text and tokens), per-position top-k logits, and the greedy continuation with each step's top-2
gap. Later tests (the GPU engine's included) compare against these files without needing llama.cpp.

usage: python tests/reference/make_goldens.py
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))

import make_models  # noqa: E402

from reference import llama  # noqa: E402

GOLDENS = ROOT / "tests" / "fixtures" / "goldens"
PROMPT_LEN = 64
CONTINUATION = 32
TOP_K = 16
# Chat markup, words the tiny vocabulary knows and some it must spell out byte by byte.
PROMPT_TEXT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "Why is the sky blue? Write a function that returns the sum of 3 numbers, then think "
    "about Rayleigh scattering: λ⁻⁴ (über-simple), naïve café ☕ 12345.<|im_end|>\n<|im_start|>assistant\n"
)


def golden_path(fixture: Path) -> Path:
    return GOLDENS / f"{fixture.stem}.json"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fixtures() -> list[Path]:
    return [make_models.fixture_path(a, k) for a in make_models.SEEDS for k in ["f32", *make_models.QUANTS]]


def make_golden(fixture: Path) -> dict:
    import llama_cpp

    llm = llama.load(fixture)
    text_tokens = llm.tokenize(PROMPT_TEXT.encode(), add_bos=False, special=True)
    if len(text_tokens) < PROMPT_LEN:
        raise RuntimeError(f"prompt text gives only {len(text_tokens)} tokens")
    prompt = [int(t) for t in text_tokens[:PROMPT_LEN]]
    lg = llama.logits(llm, prompt)
    g = llama.greedy(llm, prompt, CONTINUATION)

    def topk(rows: np.ndarray) -> list[dict]:
        out = []
        for r in rows:
            ids = np.argsort(-r, kind="stable")[:TOP_K]
            out.append({"ids": [int(i) for i in ids], "logits": [float(np.float32(r[i])) for i in ids]})
        return out

    return {
        "header": {
            "written_by": "tests/reference/make_goldens.py",
            "oracle": f"llama.cpp vendored in llama-cpp-python {llama_cpp.__version__} (CPU, F32 K/V, no flash attention)",
            "fixture": fixture.name,
            "fixture_sha256": sha256(fixture),
            "near_tie": llama.NEAR_TIE,
            "top_k": TOP_K,
        },
        "prompt_text": PROMPT_TEXT,
        "prompt_text_tokens": [int(t) for t in text_tokens],
        "prompt_tokens": prompt,
        "prompt_topk": topk(lg),
        "greedy": {
            "tokens": g.tokens,
            "gaps": [float(x) for x in g.gaps],
            "top2": [list(t) for t in g.top2],
            "topk": topk(g.logits[PROMPT_LEN - 1 :]),
        },
    }


def main() -> int:
    GOLDENS.mkdir(parents=True, exist_ok=True)
    for f in fixtures():
        golden = make_golden(f)
        golden_path(f).write_text(json.dumps(golden, separators=(",", ":")) + "\n")
        gaps = np.array(golden["greedy"]["gaps"])
        print(
            f"{golden_path(f).relative_to(ROOT)}: greedy {golden['greedy']['tokens'][:8]}… min gap {gaps.min():.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
