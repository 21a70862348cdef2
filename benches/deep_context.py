#!/usr/bin/env python3
"""One stream at a very deep context: a single-slot engine whose cache holds DEPTH positions, the
prompt prefilled once in pieces of --chunk tokens (each piece's time printed, so prefill speed is
seen falling with depth), then one-stream decode host-fed and chained right after a short prompt
and again after the deep one. Reports the KV cache's bytes (Engine.info()["memory"]) and the
rates as one JSON object on stdout; progress goes to stderr.

usage: python benches/deep_context.py MODEL.gguf [--depth 262144] [--decode 64] [--chunk 32768]
       [--cache-type-k f16|q8_0] [--cache-type-v f16]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from engine_bench import chained_rate, decode_rate, warm_up_prefill


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument(
        "--depth", type=int, default=262144, help="prompt length (the cache holds it and the decode)"
    )
    ap.add_argument("--decode", type=int, default=64, help="steps per decode measurement")
    ap.add_argument("--chunk", type=int, default=32768, help="prompt tokens per stage_run call")
    ap.add_argument("--short", type=int, default=512, help="the short prompt decoded after first")
    ap.add_argument("--cache-type-k", default=None)
    ap.add_argument("--cache-type-v", default=None)
    a = ap.parse_args()

    import qk

    # Room for the decode steps after the prompt (host-fed, then chained, each with its first step).
    ctx = a.depth + 2 * a.decode + 8
    t0 = time.perf_counter()
    eng = qk.Engine(a.model, slots=1, ctx=ctx, cache_type_k=a.cache_type_k, cache_type_v=a.cache_type_v)
    info = eng.info()
    print(f"loaded in {time.perf_counter() - t0:.1f} s: {json.dumps(info['memory'])}", file=sys.stderr)
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(0, int(info["vocab"]), a.depth)]

    for n in sorted({a.short, min(a.chunk, a.depth)}):
        warm_up_prefill(eng, tokens, n)
    ids, _ = eng.stage_run(0, tokens[: a.short], 0)
    short_fed, _ = decode_rate(eng, [0], [ids[-1]], a.decode)
    ids, _ = eng.stage_run(0, tokens[: a.short], 0)
    short_chained, _ = chained_rate(eng, [0], [ids[-1]], a.decode)

    pieces = []
    start = time.perf_counter()
    ids = None
    for at in range(0, a.depth, a.chunk):
        piece = tokens[at : at + a.chunk]
        t = time.perf_counter()
        ids, _ = eng.stage_run(0, piece, at, all_ids=False)
        dt = time.perf_counter() - t
        pieces.append(
            {"from": at, "tokens": len(piece), "s": round(dt, 3), "tok_s": round(len(piece) / dt, 1)}
        )
        print(f"prefill {at}..{at + len(piece)}: {dt:.2f} s ({len(piece) / dt:.0f} tok/s)", file=sys.stderr)
    prefill_s = time.perf_counter() - start
    deep_fed, _ = decode_rate(eng, [0], [ids[-1]], a.decode)
    # The chained steps continue after the host-fed ones (depth + decode + 1 onwards): the same
    # depth to within 0.05%, no second prefill.
    deep_chained, _ = chained_rate(eng, [0], [ids[-1]], a.decode)

    mem = info["memory"]
    res = {
        "adapter": info.get("adapter"),
        "model": a.model,
        "layers": info.get("n_layer"),
        "ctx": info.get("ctx"),
        "cache_type_k": info.get("cache_type_k"),
        "cache_type_v": info.get("cache_type_v"),
        "kv_bytes": mem["kv_per_slot"],
        "memory": mem,
        "prefill_tokens": a.depth,
        "prefill_s": round(prefill_s, 2),
        "prefill_tok_s": round(a.depth / prefill_s, 1),
        "prefill_pieces": pieces,
        "short_prompt": a.short,
        "decode_short_tok_s": round(1 / short_fed, 1),
        "decode_short_chained_tok_s": round(1 / short_chained, 1),
        "decode_deep_tok_s": round(1 / deep_fed, 1),
        "decode_deep_chained_tok_s": round(1 / deep_chained, 1),
        "deep_over_short_chained": round(short_chained / deep_chained, 3),
    }
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
