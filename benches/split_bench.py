#!/usr/bin/env python3
"""Split serving cost: decode ms/token of one stream and the 2-slot aggregate rate, unsplit (one engine,
all layers) against a 2-stage split (head engine here, ``python -m qk.worker`` in a second process
over loopback TCP), both driven by the server's scheduler — so the split side uses the split driver
as ``qk.serve --split-next`` does, with one decode lane (every slot batched into each step) and with
two (groups alternating between the stages). Every run's greedy tokens are compared with a greedy
reference computed on the whole model directly (with each position's top-2 gap, so a difference is
reported with whether it is a certified near-tie).

Prints one JSON document: each run's ms/token and aggregate, the split's ratio to unsplit against
the target (``split_over_unsplit_ms`` ≤ ``target_ratio``), where a split decode step's time goes
(the head's layers, waiting for the link thread, the chain's round trip), what limits the 2-slot
aggregate, and ``tokens_identical``. With ``--worker-device`` naming another adapter (a mixed chain:
e.g. the head on a GPU, the worker on Mesa's lavapipe) the reference is also computed on the
worker's adapter, and each comparison is reported per reference adapter.

usage: python benches/split_bench.py MODEL.gguf [--cut K] [--prompt 256] [--decode 64] [--ctx 2048]
       [--device I] [--worker-device J] [--precise] [--lanes 1,2] [--spin-wait-us N] [--socket-spin-us N]
       [--worker-in-process] [--no-weight-arena]
       [--worker-env K=V ...]
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

#: The issue's target for a 2-stage split on one GPU, one stream.
TARGET_RATIO = 1.05
#: A top-2 logit gap below this is a near-tie (docs/numerics.md "Near-tie certification").
NEAR_TIE = 0.15


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


def step_means(before: dict, after: dict) -> dict:
    """A split driver's decode steps between two readings of ``step_times()``: ms per step."""
    steps = after["steps"] - before["steps"]
    if not steps:
        return {"steps": 0}
    ms = {
        k: 1000 * (after[f"{k}_seconds"] - before[f"{k}_seconds"]) / steps
        for k in ("head", "queued", "chain")
    }
    return {
        "steps": steps,
        "rows_per_step": round((after["rows"] - before["rows"]) / steps, 2),
        **{f"{k}_ms": round(v, 3) for k, v in ms.items()},
    }


def engine_means(before: dict, after: dict) -> dict:
    """An engine's decode steps between two readings of ``step_totals()``: µs per step (host
    record, submit, and the wait for the GPU and the readback), the share recorded ahead, and the
    record of those alone (``ahead_record_us``: the mean record includes the steps recorded on the
    spot, ms each)."""
    steps = after["steps"] - before["steps"]
    if not steps:
        return {"steps": 0}
    ahead = after["ahead"] - before["ahead"]
    out = {
        "steps": steps,
        "ahead": round(ahead / steps, 3),
        **{
            k: round((after[k] - before[k]) / steps, 1)
            for k in ("record_us", "submit_us", "wait_us", "total_us")
        },
    }
    # (Older wheels' totals lack it: benches/h200_split.sh may compare two builds.)
    if ahead and "ahead_record_us" in after:
        out["ahead_record_us"] = round((after["ahead_record_us"] - before["ahead_record_us"]) / ahead, 1)
    return out


def bench(driver, a, prompts, engines: dict | None = None, link=None) -> dict:
    """The scheduler over ``driver``: one stream, then two; ``engines`` (name → engine in this
    process) get their per-step host timing for each phase, ``link`` (a split's) its idle ping."""
    s = scheduler_for(driver, 2, a.ctx)
    times = getattr(driver, "step_times", None)
    engines = engines or {}

    def reading():
        return (times() if times else None), {n: e.step_totals() for n, e in engines.items()}

    try:
        # Warm-up with the whole prompt: the prefill pieces of its length compile their own
        # pipelines (on every stage), which a shorter warm-up left to the timed prefill.
        measure(s, [prompts[0]], 4)
        r0 = reading()
        single = measure(s, [prompts[0]], a.decode)
        r1 = reading()
        both = measure(s, prompts, a.decode)
        r2 = reading()
        ping = ping_ms(link) if link is not None else None
    finally:
        s.drain(30)
    out = {"single": single, "two_slots": both}
    if ping is not None:
        out["ping_ms"] = ping
    for phase, (b, e) in (("single", (r0, r1)), ("two_slots", (r1, r2))):
        if times:
            out[phase]["step"] = step_means(b[0], e[0])
        for name in engines:
            out[phase][f"{name}_engine"] = engine_means(b[1][name], e[1][name])
    return out


def ping_ms(link, n: int = 20) -> float:
    """Median round trip of an idle ping through the chain (sockets and the workers' loops, no GPU)."""
    rtts = sorted(link.ping() for _ in range(n))
    return round(1000 * rtts[n // 2], 3)


def greedy_reference(engine, prompt: list[int], n: int) -> dict:
    """Greedy tokens straight from a whole-model engine, with each position's top-2 (ids, gap)."""
    ids, top = engine.stage_run(0, prompt, 0, 2)
    tokens, tops = [int(ids[-1])], [top]
    while len(tokens) < n:
        [(ids, top)] = engine.step([0], [tokens[-1]], 2)
        tokens.append(int(ids[0]))
        tops.append(top)
    return {
        "tokens": tokens,
        "top2": [[int(i) for i, _ in t] for t in tops],
        "gap": [float(t[0][1] - t[1][1]) for t in tops],
    }


def compare(got: list[int], ref: dict) -> dict | None:
    """None when identical; else the first differing position and whether it is a certified
    near-tie (the reference's top-2 gap there below NEAR_TIE, and the token one of its top two)."""
    for p, (g, w) in enumerate(zip(got, ref["tokens"], strict=False)):
        if g != w:
            gap = ref["gap"][p]
            return {
                "position": p,
                "got": g,
                "want": w,
                "gap": round(gap, 4),
                "certified_near_tie": gap < NEAR_TIE and g in ref["top2"][p],
            }
    if len(got) != len(ref["tokens"]):
        return {"position": min(len(got), len(ref["tokens"])), "lengths": [len(got), len(ref["tokens"])]}
    return None


def summary(r: dict, prompt_len: int) -> dict:
    out = {
        # The single stream's first token lands when its whole prompt has been prefilled.
        "prefill_tok_s": round(prompt_len / r["single"]["first_token_s"][0], 1),
        "single_ms_per_token": round(r["single"]["ms_per_token"][0], 3),
        "single_tok_s": round(1000 / r["single"]["ms_per_token"][0], 1),
        "two_slot_aggregate_tok_s": round(r["two_slots"]["aggregate_tok_s"], 1),
    }
    out["two_slot_over_single"] = round(out["two_slot_aggregate_tok_s"] / out["single_tok_s"], 3)
    for phase in ("single", "two_slots"):
        for key, value in r[phase].items():
            if key == "step" or key.endswith("_engine"):
                out[f"{phase}_{key}"] = value
    if "ping_ms" in r:
        out["ping_ms"] = r["ping_ms"]
    return out


def worker_process(a, model: str, cut: int, n_layer: int, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "qk.worker", "--model", model, "--layers", f"{cut}:{n_layer}"]
    cmd += ["--port", str(port), "--slots", "2", "--ctx", str(a.ctx)]
    if a.worker_device is not None:
        cmd += ["--device", a.worker_device]
    if a.precise:
        cmd.append("--precise")
    if a.spin_wait_us is not None:
        cmd += ["--spin-wait-us", str(a.spin_wait_us)]
    if a.no_weight_arena:
        cmd.append("--no-weight-arena")
    if a.armed_steps:
        cmd.append("--armed-steps")
    env = dict(os.environ)
    for kv in a.worker_env:
        k, _, v = kv.partition("=")
        env[k] = v
    return subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr, env=env)


def engine_options(a) -> dict:
    """Every engine's keywords for ``--spin-wait-us``, ``--no-weight-arena`` and ``--armed-steps``
    (the stages'; the whole-model reference is never armed, so unsplit measures what it did): none
    when not given (the engine's defaults; so an older wheel without an option still runs)."""
    options = {} if a.spin_wait_us is None else {"spin_wait_us": a.spin_wait_us}
    if a.no_weight_arena:
        options["weight_arena"] = False
    if a.armed_steps:
        options["armed_steps"] = True
    return options


def socket_spin(a, engine) -> int:
    """How long a stage's socket waits poll: ``--socket-spin-us``, else its engine's GPU waits' (as
    ``qk.serve`` and ``qk.worker`` do)."""
    return a.socket_spin_us if a.socket_spin_us is not None else int(engine.info()["spin_wait_us"])


class InProcessWorker:
    """The worker stage served from a thread of this process, with ``worker_process``'s interface."""

    def __init__(self, a, cut: int, n_layer: int, port: int):
        import threading

        from qk import _qk
        from qk.gguf import Gguf

        self.engine = _qk.Engine(
            a.model,
            layers=(cut, n_layer),
            slots=2,
            ctx=a.ctx,
            device=a.worker_device if a.worker_device is not None else a.device,
            precise=a.precise,
            **engine_options(a),
        )
        fingerprint = Gguf(a.model, header_only=True).fingerprint
        stage = _qk.EngineStage(self.engine, fingerprint, 16)
        self.worker = _qk.Worker(
            stage, port=port, name=f"127.0.0.1:{port}", spin_wait_us=socket_spin(a, self.engine)
        )
        self.thread = threading.Thread(target=self.worker.serve, name="bench-worker", daemon=True)
        self.thread.start()

    def poll(self):
        return None if self.thread.is_alive() else 0

    def terminate(self):
        self.worker.stop()

    def wait(self, timeout: float):
        self.thread.join(timeout)


def two_slot_limit(u: dict, s: dict) -> dict:
    """What bounds the split's 2-slot aggregate with one lane, from measured numbers: the stages
    share the device, so a 2-slot step costs at least the unsplit engine's 2-row step; the rest is
    the split's own per-step cost (the second readback, the hop, host work)."""
    unsplit_step = 2000 / u["two_slot_aggregate_tok_s"] if u["two_slot_aggregate_tok_s"] else None
    split_step = 2000 / s["two_slot_aggregate_tok_s"] if s["two_slot_aggregate_tok_s"] else None
    out = {
        "unsplit_step_ms": unsplit_step and round(unsplit_step, 3),
        "split_step_ms": split_step and round(split_step, 3),
    }
    if unsplit_step and split_step:
        extra = split_step - unsplit_step
        out["split_extra_ms"] = round(extra, 3)
        out["limited_by"] = (
            "the shared GPU's compute: the split's 2-slot step costs at most 5% over unsplit's"
            if extra <= 0.05 * unsplit_step
            else "the split's per-step cost (see split_lanes1.two_slots_step: head, link queue, chain round trip)"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--cut", type=int, default=None, help="first layer of the worker (default: half)")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--device", default=None, help="the head's (and unsplit's) adapter")
    ap.add_argument("--worker-device", default=None, help="the worker's adapter (default: the head's)")
    ap.add_argument("--precise", action="store_true", help="f32 throughout, on every stage")
    ap.add_argument("--lanes", default="1,2", help="split runs to make, by lanes (default: 1,2)")
    ap.add_argument(
        "--spin-wait-us", type=int, default=None, help="every engine's wait polling (default: the engine's)"
    )
    ap.add_argument(
        "--socket-spin-us",
        type=int,
        default=None,
        help="the head's and an in-process worker's socket waits' polling (default: their engines')",
    )
    ap.add_argument(
        "--worker-in-process",
        action="store_true",
        help="serve the worker from a thread of this process: one device and queue for both stages "
        "(no switch between two processes' GPU contexts), its engine's timing reported",
    )
    ap.add_argument(
        "--no-weight-arena",
        action="store_true",
        help="every engine's weight tensors each in a buffer of their own (default: the small ones in arenas)",
    )
    ap.add_argument(
        "--armed-steps",
        action="store_true",
        help="both stages submit each decode step's successor ahead, held on the GPU until its input "
        "arrives (each stage then takes a device of its own, also in process)",
    )
    ap.add_argument("--worker-env", action="append", default=[], help="K=V for the worker's environment")
    a = ap.parse_args()
    lanes = [int(x) for x in a.lanes.split(",")]

    from qk import _qk
    from qk.driver import LocalDriver
    from qk.gguf import Gguf
    from qk.split import SplitDriver, head_stage

    rng = np.random.default_rng(0)
    options = engine_options(a)
    unarmed = {k: v for k, v in options.items() if k != "armed_steps"}
    whole = _qk.Engine(a.model, slots=2, ctx=a.ctx, device=a.device, precise=a.precise, **unarmed)
    info = whole.info()
    n_layer, vocab = int(info["n_layer"]), int(info["vocab"])
    cut = a.cut or n_layer // 2
    prompts = [[int(t) for t in rng.integers(0, vocab, a.prompt)] for _ in range(2)]
    references = {str(info["adapter"]): [greedy_reference(whole, p, a.decode) for p in prompts]}
    unsplit = bench(LocalDriver(whole), a, prompts, {"unsplit": whole})
    unsplit_timing = whole.last_step_timing()
    del whole
    worker_adapter = None
    if a.worker_device is not None:
        other = _qk.Engine(a.model, slots=1, ctx=a.ctx, device=a.worker_device, precise=a.precise)
        worker_adapter = str(other.info()["adapter"])
        if worker_adapter not in references:
            references[worker_adapter] = [greedy_reference(other, p, a.decode) for p in prompts]
        del other

    port = free_port()
    if a.worker_in_process:
        worker = InProcessWorker(a, cut, n_layer, port)
        engines = {"worker": worker.engine}
    else:
        worker = worker_process(a, a.model, cut, n_layer, port)
        engines = {}
    split: dict[int, dict] = {}
    head_timing = None
    try:
        head = _qk.Engine(
            a.model, layers=(0, cut), slots=2, ctx=a.ctx, device=a.device, precise=a.precise, **options
        )
        fingerprint = Gguf(a.model, header_only=True).fingerprint
        for n in lanes:
            # A stopped scheduler closes its driver (and the driver its link), as a server's
            # shutdown does: each measurement gets a driver and a chain session of its own.
            own = head_stage(head, fingerprint, 4, "bench-head", 1)
            link = _qk.HeadLink(
                f"127.0.0.1:{port}",
                own,
                connect_timeout=2.0,
                hello_timeout=600.0,
                spin_wait_us=socket_spin(a, head),
            )
            driver = SplitDriver(head, link, ticker=False, lanes=n)
            deadline = time.monotonic() + 600
            while not driver.connect():
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the worker did not come up")
                time.sleep(0.5)
            if worker_adapter is None:
                worker_adapter = str(link.chain[0]["adapter"])
            split[n] = bench(driver, a, prompts, {"head": head, **engines}, link)
            head_timing = head.last_step_timing()
    finally:
        worker.terminate()
        worker.wait(60)

    runs = {"unsplit": unsplit, **{f"split_lanes{n}": r for n, r in split.items()}}
    identical: dict[str, dict[str, dict | None]] = {}
    for adapter, refs in references.items():
        identical[adapter] = {}
        for name, r in runs.items():
            for phase in ("single", "two_slots"):
                for i, toks in enumerate(r[phase]["tokens"]):
                    identical[adapter][f"{name}.{phase}.{i}"] = compare(toks, refs[i])
    u = summary(unsplit, a.prompt)
    out = {
        "adapter": str(info["adapter"]),
        "worker_adapter": worker_adapter,
        "model": os.path.basename(a.model),
        "n_layer": n_layer,
        "cut": cut,
        "precise": a.precise,
        "spin_wait_us": a.spin_wait_us,
        "worker_in_process": a.worker_in_process,
        "socket_spin_us": a.socket_spin_us,
        "weight_arena": not a.no_weight_arena,
        "armed_steps": a.armed_steps,
        "unsplit": u,
        "unsplit_last_step_us": unsplit_timing,
        "head_last_step_us": head_timing,
    }
    for n, r in split.items():
        out[f"split_lanes{n}"] = summary(r, a.prompt)
    if 1 in split:
        s1 = out["split_lanes1"]
        out["split_over_unsplit_ms"] = round(s1["single_ms_per_token"] / u["single_ms_per_token"], 3)
        out["split_extra_ms_per_token"] = round(s1["single_ms_per_token"] - u["single_ms_per_token"], 3)
        out["target_ratio"] = TARGET_RATIO
        out["meets_target"] = out["split_over_unsplit_ms"] <= TARGET_RATIO
        out["two_slot_limit"] = two_slot_limit(u, s1)
    differences = {
        adapter: {k: v for k, v in runs_.items() if v is not None} for adapter, runs_ in identical.items()
    }
    out["tokens_identical"] = all(not d for d in differences.values())
    out["tokens_identical_per_reference"] = {adapter: not d for adapter, d in differences.items()}
    if not out["tokens_identical"]:
        out["differences"] = differences
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
