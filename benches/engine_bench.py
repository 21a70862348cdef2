#!/usr/bin/env python3
"""Engine throughput on one adapter: prefill tokens/s, single-stream decode ms/token and the
aggregate decode rate of several slots stepped together. Host overhead (Python, one readback per
step) is included, as a server sees it.

usage: python benches/engine_bench.py MODEL.gguf [--prompt 512] [--decode 128] [--slots 2] [--ctx 8192]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--device", default=None)
    a = ap.parse_args()

    import qk

    t0 = time.perf_counter()
    eng = qk.Engine(a.model, slots=a.slots, ctx=a.ctx, device=a.device)
    load_s = time.perf_counter() - t0
    info = eng.info()
    vocab = int(info.get("vocab", 1000))
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, vocab, a.prompt)]

    # Warm-up compiles every pipeline once (prefill and decode shapes).
    ids, _ = eng.stage_run(0, prompt[:64], 0)
    eng.stage_run(0, [ids[-1]], 64)

    t0 = time.perf_counter()
    ids, _ = eng.stage_run(0, prompt, 0)
    prefill_s = time.perf_counter() - t0

    tok, pos = ids[-1], a.prompt
    t0 = time.perf_counter()
    for _ in range(a.decode):
        ids, _ = eng.stage_run(0, [tok], pos)
        tok, pos = ids[-1], pos + 1
    decode_s = time.perf_counter() - t0

    slots = list(range(a.slots))
    for s in slots:
        eng.stage_run(s, prompt[:64], 0)
    toks, base = [1] * a.slots, 64
    eng.step(slots, toks)  # warm-up of the multi-slot shapes
    base += 1
    t0 = time.perf_counter()
    for _ in range(a.decode):
        outs = eng.step(slots, toks)
        toks = [o[0][-1] for o in outs]
        base += 1
    multi_s = time.perf_counter() - t0

    res = {
        "adapter": info.get("adapter"),
        "model": a.model,
        "layers": info.get("n_layer"),
        "load_s": round(load_s, 2),
        "prefill_tokens": a.prompt,
        "prefill_tok_s": round(a.prompt / prefill_s, 1),
        "decode_ms_per_token": round(1000 * decode_s / a.decode, 3),
        "decode_tok_s": round(a.decode / decode_s, 1),
        "slots": a.slots,
        "multi_slot_aggregate_tok_s": round(a.slots * a.decode / multi_s, 1),
        "counters": eng.counters(),
    }
    print(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
