#!/usr/bin/env python3
"""Split serving cost on one machine: decode ms/token single-stream and the 2-slot aggregate rate,
unsplit (one engine, all layers) against a 2-stage split (head engine here, ``python -m qk.worker`` in
a second process over loopback TCP), both driven by the server's scheduler — so the split side uses
the pipelined driver as ``qk.serve --split-next`` does, with one decode lane (every slot batched
into each step) and with two (groups alternating between the stages). Greedy outputs are compared
token for token.

usage: python benches/split_bench.py MODEL.gguf [--cut K] [--prompt 256] [--decode 64] [--ctx 2048]
       [--device I] [--worker-device J]   (J: the worker's adapter, for a split across two GPUs)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(scheduler, prompts: list[list[int]], decode: int) -> dict:
    """Run the prompts concurrently; per job: prefill seconds, decode ms/token and its tokens."""
    from qk.scheduler import Failed, Finished, GenerationRequest, Token

    async def one(prompt):
        job = scheduler.submit(GenerationRequest(prompt, max_tokens=decode))
        times, tokens = [], []
        while True:
            ev = await job.next_event()
            if isinstance(ev, Token):
                times.append(time.perf_counter())
                tokens.append(ev.id)
            elif isinstance(ev, Finished):
                return times, tokens
            elif isinstance(ev, Failed):
                raise ev.error

    async def run():
        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        return start, results

    start, results = asyncio.run(run())
    first = max(r[0][0] for r in results)  # every job decoding from here on
    last = min(r[0][-1] for r in results)
    in_window = sum(sum(first <= t <= last for t in times) for times, _ in results)
    return {
        "ms_per_token": [1000 * (t[-1] - t[0]) / (len(t) - 1) for t, _ in results],
        "aggregate_tok_s": in_window / (last - first) if last > first else 0.0,
        "first_token_s": [t[0] - start for t, _ in results],
        "tokens": [toks for _, toks in results],
    }


def scheduler_for(driver, slots: int, ctx: int):
    from qk.scheduler import Scheduler

    s = Scheduler(lambda: driver, slots=slots, ctx=ctx)
    s.start()
    while s.state == "loading":
        time.sleep(0.01)
    if s.state != "ready":
        raise RuntimeError(s.unavailable_reason())
    return s


def bench(driver, a, prompts) -> dict:
    s = scheduler_for(driver, 2, a.ctx)
    try:
        measure(s, [prompts[0][:64]], 4)  # warm-up: every pipeline compiled once
        single = measure(s, [prompts[0]], a.decode)
        both = measure(s, prompts, a.decode)
    finally:
        s.drain(30)
    return {"single": single, "two_slots": both}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--cut", type=int, default=None, help="first layer of the worker (default: half)")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--device", default=None)
    ap.add_argument("--worker-device", default=None)
    a = ap.parse_args()

    from qk import _qk
    from qk.driver import LocalDriver
    from qk.gguf import Gguf
    from qk.split import SplitDriver, head_stage

    rng = np.random.default_rng(0)
    whole = _qk.Engine(a.model, slots=2, ctx=a.ctx, device=a.device)
    info = whole.info()
    n_layer, vocab = int(info["n_layer"]), int(info["vocab"])
    cut = a.cut or n_layer // 2
    prompts = [[int(t) for t in rng.integers(0, vocab, a.prompt)] for _ in range(2)]
    unsplit = bench(LocalDriver(whole), a, prompts)
    del whole

    port = free_port()
    cmd = [sys.executable, "-m", "qk.worker", "--model", a.model, "--layers", f"{cut}:{n_layer}"]
    cmd += ["--port", str(port), "--slots", "2", "--ctx", str(a.ctx)]
    if a.worker_device is not None:
        cmd += ["--device", a.worker_device]
    worker = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr, env=dict(os.environ))
    try:
        head = _qk.Engine(a.model, layers=(0, cut), slots=2, ctx=a.ctx, device=a.device)
        fingerprint = Gguf(a.model, header_only=True).fingerprint

        def split_bench(lanes: int) -> dict:
            # A stopped scheduler closes its driver (and the driver its link), as a server's
            # shutdown does: each measurement gets a driver and a chain session of its own.
            own = head_stage(head, fingerprint, 4, "bench-head", 1)
            link = _qk.HeadLink(f"127.0.0.1:{port}", own, connect_timeout=2.0, hello_timeout=600.0)
            driver = SplitDriver(head, link, ticker=False, lanes=lanes)
            deadline = time.monotonic() + 600
            while not driver.connect():
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the worker did not come up")
                time.sleep(0.5)
            return bench(driver, a, prompts)

        split = split_bench(1)
        split2 = split_bench(2)
    finally:
        worker.terminate()
        worker.wait(60)

    def summary(r: dict) -> dict:
        return {
            # The single stream's first token lands when its whole prompt has been prefilled.
            "prefill_tok_s": round(a.prompt / r["single"]["first_token_s"][0], 1),
            "single_ms_per_token": round(r["single"]["ms_per_token"][0], 3),
            "two_slot_aggregate_tok_s": round(r["two_slots"]["aggregate_tok_s"], 1),
            "single_tok_s": round(1000 / r["single"]["ms_per_token"][0], 1),
        }

    u, s, s2 = summary(unsplit), summary(split), summary(split2)
    same = all(
        unsplit[k]["tokens"] == r[k]["tokens"] for r in (split, split2) for k in ("single", "two_slots")
    )
    out = {
        "adapter": info["adapter"],
        "model": os.path.basename(a.model),
        "n_layer": n_layer,
        "cut": cut,
        "worker_device": a.worker_device,
        "unsplit": u,
        "split_lanes1": s,
        "split_lanes2": s2,
        "split_over_unsplit_ms": round(s["single_ms_per_token"] / u["single_ms_per_token"], 3),
        "split_lanes1_two_slot_over_single": round(s["two_slot_aggregate_tok_s"] / s["single_tok_s"], 3),
        "split_lanes2_two_slot_over_single": round(s2["two_slot_aggregate_tok_s"] / s["single_tok_s"], 3),
        "unsplit_two_slot_over_single": round(u["two_slot_aggregate_tok_s"] / u["single_tok_s"], 3),
        "tokens_identical": same,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
