#!/usr/bin/env python3
"""Decode through the scheduler (the server's path without HTTP): the aggregate greedy tok/s of 1, 2,
4 and 8 concurrent streams with chained steps (the default) and with every step's tokens through
the host, and Engine.step's own rate for the same row counts, so a scheduler-level cost shows as
the gap between the two. Prints one JSON document.

usage: python benches/scheduler_bench.py MODEL.gguf [--slots 8] [--ctx 33792] [--decode 128]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from engine_bench import chained_rate, decode_rate, scheduler_rates


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=33792)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--device", default=None)
    a = ap.parse_args()

    import qk

    eng = qk.Engine(a.model, slots=a.slots, ctx=a.ctx, device=a.device)
    info = eng.info()
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, int(info["vocab"]), 64 + a.slots)]
    streams = [k for k in (1, 2, 4, 8) if k <= a.slots]
    engine = {}
    for k in streams:
        slots = list(range(k))
        for s in slots:
            eng.stage_run(s, tokens[s : s + 64], 0)
        fed, _ = decode_rate(eng, slots, [1] * k, a.decode)
        for s in slots:
            eng.stage_run(s, tokens[s : s + 64], 0)
        chained, _ = chained_rate(eng, slots, [1] * k, a.decode)
        engine[k] = {"fed_tok_s": round(k / fed, 1), "chained_tok_s": round(k / chained, 1)}
    t0 = time.perf_counter()
    out = {
        "adapter": info.get("adapter"),
        "layers": info.get("n_layer"),
        "ctx": a.ctx,
        "engine_step": engine,
        "scheduler_chained": scheduler_rates(eng, a.slots, a.ctx, streams, tokens, a.decode),
        "scheduler_host_fed": scheduler_rates(eng, a.slots, a.ctx, streams, tokens, a.decode, chains=False),
    }
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
