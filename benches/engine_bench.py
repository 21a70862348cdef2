#!/usr/bin/env python3
"""Engine throughput on one adapter: prefill tokens/s, single-stream decode ms/token and the
aggregate decode rate of several slots stepped together. Host overhead (Python, one readback per
step) is included, as a server sees it. Decode is measured three ways: host-fed steps
(``Engine.step``: each step's tokens go through the host), chained steps (``step_submit`` with the
next step queued behind the running one, fed on the GPU: what the scheduler does for greedy
requests), and through the scheduler itself (``qk.scheduler`` over a ``LocalDriver``: 1, 2, 4 and
8 concurrent greedy streams, the server's path without HTTP).

--profile adds a profiled decode step of 1 slot and of all slots (Engine.profile_step) and profiled
prefill pieces of 512 and 64 tokens (Engine.profile_stage_run): per op family
the dispatches, GPU µs (timestamp queries; "n/a" where the adapter has none) and achieved GB/s over
the weight bytes it reads, then dispatches and submits per token and the host µs of a plain step
(recording vs submit+wait), and the slowest single ops. The tables go to stderr; the JSON result
gains a "profile" entry.

Engine speed choices, to compare in the engine itself rather than in the kernel bench:
--route-inside-max-rows, --attention-walk, --dense-group-cols, --spin-wait-us, --decode-shape
OP=ROWS,WIDTH,STEPS,GROUPS[,table|shuffle] (an op of the decode step by its profile name, e.g.
dn.qkvz=8,32,2,2 or moe.gate_up=8,64,1,1,shuffle; repeatable), --no-weight-arena (every weight in
a buffer of its own).

usage: python benches/engine_bench.py MODEL.gguf [--prompt 512] [--decode 128] [--slots 2] [--ctx 8192]
       [--profile] [--top 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

# The engine's smallest default prefill piece (rust/engine.rs PREFILL_PIECE): positions per recorded
# submit; an engine reports its own in info()["prefill_rows"].
PIECE = 512


def fmt(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def profile_report(eng, slots: list[int], toks: list[int], top: int) -> dict:
    """One plain step (its host timing is the one quoted), then one profiled step of `slots`."""
    eng.step(slots, toks)
    prof = eng.profile_step(slots, toks)
    return print_profile(prof, f"decode step: {len(slots)} slot(s)", top)


def print_profile(prof: dict, title: str, top: int) -> dict:
    """The profile's tables on stderr; its summary for the JSON result."""
    st = prof["step"]
    rows = st["rows"]
    out = sys.stderr
    print(f"\n== profiled {title}, timestamps {st['timestamps']}", file=out)
    print(
        f"{'op family':<18}{'disp':>6}{'GPU us':>10}{'%GPU':>7}{'MB read':>10}{'GB/s':>9}  kernels", file=out
    )
    busy = st["gpu_busy_us"]
    for f in prof["families"]:
        share = None if busy in (None, 0) or f["gpu_us"] is None else 100 * f["gpu_us"] / busy
        kernels = ", ".join(sorted({k.split("[")[0] for k in f["kernels"]}))
        print(
            f"{f['op']:<18}{f['dispatches']:>6}{fmt(f['gpu_us'], '.1f'):>10}{fmt(share, '.1f'):>7}"
            f"{f['bytes'] / 1e6:>10.2f}{fmt(f['gb_s'], '.1f'):>9}  {kernels}",
            file=out,
        )
    normal = st["normal"] or {}
    prof_t = st["profiled"]
    print(
        f"per token: {st['dispatches'] / rows:.1f} dispatches, {st['submits'] / rows:.2f} submits; "
        f"step created {st['created_pipelines']} pipelines, {st['created_bind_groups']} bind groups",
        file=out,
    )
    print(
        f"GPU: busy {fmt(busy, '.1f')} us (sum of dispatches), span {fmt(st['gpu_span_us'], '.1f')} us "
        "(profiled: one pass per dispatch)",
        file=out,
    )
    print(
        f"host, plain step: record+encode {fmt(normal.get('record_us'), '.1f')} us, submit "
        f"{fmt(normal.get('submit_us'), '.1f')} us, GPU+readback wait {fmt(normal.get('wait_us'), '.1f')} us, "
        f"total {fmt(normal.get('total_us'), '.1f')} us; "
        f"profiled step: record {prof_t['record_us']:.1f} us, total {prof_t['total_us']:.1f} us",
        file=out,
    )
    if top > 0 and st["timestamps"]:
        print(f"slowest {top} ops:", file=out)
        ops = sorted(prof["ops"], key=lambda o: -(o["gpu_us"] or 0.0))[:top]
        for o in ops:
            print(
                f"  L{o['layer'] if o['layer'] is not None else '-':<4}{o['op']:<18}{o['dispatches']:>4}"
                f"{o['gpu_us']:>10.1f} us{fmt(o['gb_s'], '.1f'):>9} GB/s  {', '.join(o['kernels'])}",
                file=out,
            )
    # The JSON keeps the step summary and the eight heaviest families (the tables hold the rest).
    return {
        "rows": rows,
        "step": st,
        "families": [
            {k: f[k] for k in ("op", "dispatches", "gpu_us", "bytes", "gb_s")} for f in prof["families"][:8]
        ],
    }


def piece_shapes(n: int, piece: int = PIECE) -> list[int]:
    """The piece lengths the engine may cut a prefill of n tokens from position 0 into
    (rust/engine.rs piece_len): full pieces, then the rest, whose last partial chunk runs as a piece
    of its own when it would take another kernel class (up to 15 columns: the mat-vec, or f32 tiles
    where the adapter has cooperative ones); both cuts are listed where that depends on the adapter."""
    shapes: set[int] = set()
    left = n
    while left > piece:
        shapes.add(piece)
        left -= piece
    tail = left % 64
    shapes.add(left)
    if left > 64 and 0 < tail <= 15:
        shapes.update({left - tail, tail})
    return sorted(shapes - {0})


def warm_up_prefill(eng, tokens: list[int], n: int) -> None:
    """Run each piece shape of an n-token prefill once, from position 0 (each call cuts into the
    same pieces as that part of the timed run)."""
    for length in piece_shapes(n, eng.info()["prefill_rows"]):
        eng.stage_run(0, tokens[:length], 0, all_ids=False)


def decode_rate(eng, slots: list[int], toks: list[int], n: int) -> tuple[float, list[list[int]]]:
    """Seconds per step of `n` steps of `slots` through Engine.step (each step's tokens fed by the
    host; the next step is recorded while the GPU runs this one), and every step's tokens."""
    rate, seen, _ = decode_rate_timed(eng, slots, toks, n)
    return rate, seen


def decode_rate_timed(eng, slots: list[int], toks: list[int], n: int) -> tuple[float, list[list[int]], dict]:
    """`decode_rate`, plus where the steps' time went: the median and the largest of each
    `Engine.last_step_timing` field and of the whole Python call, over the `n` steps (one sample
    hides a slow step; the rate is their mean)."""
    # The first step of a shape records both it and its successor.
    toks = [o[0][-1] for o in eng.step(slots, toks)]
    t0 = time.perf_counter()
    seen = []
    timings = []
    for _ in range(n):
        t = time.perf_counter()
        outs = eng.step(slots, toks)
        call_us = (time.perf_counter() - t) * 1e6
        timings.append({**eng.last_step_timing(), "call_us": call_us})
        toks = [o[0][-1] for o in outs]
        seen.append(toks)
    rate = (time.perf_counter() - t0) / n
    fields = [k for k in timings[0] if k != "rows"]
    spread = {
        k: {
            "median": round(statistics.median(t[k] for t in timings), 1),
            "max": round(max(t[k] for t in timings), 1),
        }
        for k in fields
    }
    return rate, seen, spread


def chained_rate(eng, slots: list[int], toks: list[int], n: int) -> tuple[float, list[list[int]]]:
    """Seconds per step of `n` chained steps of `slots` after one host-fed step of `toks`, each
    submitted (fed on the GPU) before its predecessor is collected, and every step's tokens."""
    outs = eng.step_collect(eng.step_submit(slots, toks, chain_next=True))
    seen = []
    t0 = time.perf_counter()
    prev = eng.step_submit(slots, None, chain_next=True)
    for _ in range(n - 1):
        nxt = eng.step_submit(slots, None, chain_next=True)
        outs = eng.step_collect(prev)
        seen.append([o[0][-1] for o in outs])
        prev = nxt
    seen.append([o[0][-1] for o in eng.step_collect(prev)])
    return (time.perf_counter() - t0) / n, seen


def scheduler_rates(
    eng, slots: int, ctx: int, streams: list[int], prompt: list[int], n: int, chains: bool = True
) -> dict:
    """Aggregate greedy decode tok/s of k concurrent streams through the scheduler (prefill
    excluded: tokens counted from the moment every stream decodes until the first one ends).
    ``chains=False``: a driver that never chains (every step's tokens through the host)."""
    import asyncio

    from qk.driver import LocalDriver
    from qk.scheduler import Finished, GenerationRequest, Scheduler, Token

    class Unchained(LocalDriver):
        chains = False

    sched = Scheduler(lambda: (LocalDriver if chains else Unchained)(eng), slots=slots, ctx=ctx)
    sched.start()
    while sched.state == "loading":
        time.sleep(0.01)

    async def one(p: list[int]) -> list[float]:
        job = sched.submit(GenerationRequest(p, max_tokens=n))
        times = []
        while True:
            ev = await job.next_event()
            if isinstance(ev, Token):
                times.append(time.perf_counter())
            elif isinstance(ev, Finished):
                return times
            else:
                raise RuntimeError(f"stream failed: {ev}")

    async def run(k: int) -> list[list[float]]:
        return await asyncio.gather(*(one(prompt[i : i + 64]) for i in range(k)))

    out = {}
    for k in streams:
        if k > slots:
            continue
        # A first run of each stream count builds the pipelines of its batch shapes (on a driver
        # with a cold shader cache that stall would land inside the measured window).
        asyncio.run(run(k))
        # The median of three runs: one run's figure moved by a quarter between two leases of the
        # same code (2026-12-02: one stream 241.7, then 184.6 tok/s).
        rates = []
        for _ in range(3):
            times = asyncio.run(run(k))
            first, last = max(t[0] for t in times), min(t[-1] for t in times)
            window = sum(sum(first <= x <= last for x in t) for t in times)
            if last > first:
                rates.append(window / (last - first))
        out[k] = round(statistics.median(rates), 1) if rates else None
    sched.drain(30)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=512, help="prefill length, then one-stream decode after it")
    ap.add_argument("--decode", type=int, default=128, help="steps per decode measurement")
    ap.add_argument(
        "--depths", default="", help="comma list: one-stream decode after a prompt of each length"
    )
    ap.add_argument("--long", default="", help="comma list: also time a prefill of each of these lengths")
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--device", default=None)
    ap.add_argument("--precise", action="store_true", help="f32 everywhere (the reference gates' setting)")
    ap.add_argument(
        "--prefill-rows", type=int, default=None, help="positions per prefill piece (default: the engine's)"
    )
    ap.add_argument(
        "--route-inside-max-rows",
        type=int,
        default=None,
        help="decode steps of up to this many slots route inside the experts' gate/up, larger ones run "
        "the router kernel first (default: the engine's, 1)",
    )
    ap.add_argument(
        "--attention-walk",
        default=None,
        help="COLS,UNROLL,MIN_SPLIT[,LANES]: how decode attention walks a row's keys (default: the engine's)",
    )
    ap.add_argument(
        "--dense-group-cols",
        type=int,
        default=None,
        help="columns per workgroup of the decode step's dense mat-vecs, 1-8 (default: the engine's)",
    )
    ap.add_argument(
        "--spin-wait-us",
        type=int,
        default=None,
        help="how long a decode step's wait polls before it blocks, µs (default: the engine's)",
    )
    ap.add_argument(
        "--decode-shape",
        action="append",
        default=[],
        metavar="OP=ROWS,WIDTH,STEPS,GROUPS[,LOOKUP]",
        help="launch shape of a decode step's op by profile name (e.g. dn.qkvz=8,32,2,2 or "
        "moe.down=16,128,1,1,table); repeatable",
    )
    ap.add_argument(
        "--no-weight-arena",
        action="store_true",
        help="every weight tensor in a buffer of its own (default: the small ones packed in arenas)",
    )
    ap.add_argument(
        "--armed-steps",
        action="store_true",
        help="host-fed steps armed (each submits its successor ahead, held until its input lands; "
        "the engine takes a device of its own): the host-fed figures change, the chained ones should not",
    )
    ap.add_argument(
        "--tensor-core-decode-cols",
        type=int,
        metavar="N",
        help="decode steps of at least N slots run the mixers' dense products on tensor cores (f16 inputs)",
    )
    ap.add_argument("--profile", action="store_true", help="add per-op GPU/host profiles of a decode step")
    ap.add_argument("--top", type=int, default=15, help="with --profile: list the N slowest single ops")
    a = ap.parse_args()

    import qk

    t0 = time.perf_counter()
    # Options passed only when given, so this script also drives wheels older than an option
    # (benches/h200_ab.sh compares two builds with one copy of it).
    options = {} if a.route_inside_max_rows is None else {"route_inside_max_rows": a.route_inside_max_rows}
    if a.attention_walk is not None:
        options["attention_walk"] = tuple(int(v) for v in a.attention_walk.split(","))
    if a.dense_group_cols is not None:
        options["dense_group_cols"] = a.dense_group_cols
    if a.spin_wait_us is not None:
        options["spin_wait_us"] = a.spin_wait_us
    if a.no_weight_arena:
        options["weight_arena"] = False
    if a.armed_steps:
        options["armed_steps"] = True
    if a.tensor_core_decode_cols is not None:
        options["tensor_core_decode_cols"] = a.tensor_core_decode_cols
    if a.decode_shape:
        options["decode_shapes"] = {
            op: tuple(v if v.isalpha() else int(v) for v in shape.split(","))
            for op, shape in (s.split("=", 1) for s in a.decode_shape)
        }
    eng = qk.Engine(
        a.model,
        slots=a.slots,
        ctx=a.ctx,
        device=a.device,
        precise=a.precise,
        prefill_rows=a.prefill_rows,
        **options,
    )
    load_s = time.perf_counter() - t0
    info = eng.info()
    vocab = int(info.get("vocab", 1000))
    rng = np.random.default_rng(0)
    longs = [int(n) for n in a.long.split(",") if n]
    longest = max([a.prompt, *longs] + [int(d) for d in a.depths.split(",") if d])
    tokens = [int(t) for t in rng.integers(0, vocab, longest)]
    prompt = tokens[: a.prompt]

    # Warm-up compiles every pipeline the timed runs use: kernels and tiles follow the piece's
    # column count, so each piece shape of each timed prefill runs once (a full piece, the last
    # partial one), then a decode step.
    for n in sorted({a.prompt, *longs} - {0}):
        warm_up_prefill(eng, tokens, n)
    warm = prompt[:64]
    ids, _ = eng.stage_run(0, warm, 0)
    eng.stage_run(0, [ids[-1]], len(warm))

    # The median of three timed prefills (one run is at the mercy of clocks and the host).
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        # What serving asks of a prompt: its final id (the LM head skips the other rows).
        ids, _ = eng.stage_run(0, prompt, 0, all_ids=False)
        runs.append(time.perf_counter() - t0)
    prefill_s = sorted(runs)[1]
    step_s, fed, timing = decode_rate_timed(eng, [0], [ids[-1]], a.decode)
    ids, _ = eng.stage_run(0, prompt, 0)
    chained_s, chained = chained_rate(eng, [0], [ids[-1]], a.decode)

    depth = {}
    for d in [int(d) for d in a.depths.split(",") if d]:
        ids, _ = eng.stage_run(0, tokens[:d], 0)
        s, _ = decode_rate(eng, [0], [ids[-1]], a.decode)
        ids, _ = eng.stage_run(0, tokens[:d], 0)
        c, _ = chained_rate(eng, [0], [ids[-1]], a.decode)
        depth[d] = {
            "ms_per_token": round(1000 * s, 3),
            "tok_s": round(1 / s, 1),
            "chained_ms_per_token": round(1000 * c, 3),
            "chained_tok_s": round(1 / c, 1),
        }
    long = {}
    for n in longs:
        t0 = time.perf_counter()
        eng.stage_run(0, tokens[:n], 0, all_ids=False)
        dt = time.perf_counter() - t0
        long[n] = {"s": round(dt, 3), "tok_s": round(n / dt, 1)}

    slots = list(range(a.slots))
    for s in slots:
        eng.stage_run(s, prompt[:64], 0)
    multi_s, seen = decode_rate(eng, slots, [1] * a.slots, a.decode)
    toks = seen[-1]
    for s in slots:
        eng.stage_run(s, prompt[:64], 0)
    multi_chained_s, _ = chained_rate(eng, slots, [1] * a.slots, a.decode)
    through_scheduler = scheduler_rates(eng, a.slots, a.ctx, [1, 2, 4, 8], tokens, a.decode)
    profiles = []
    if a.profile:
        for n in sorted({1, min(2, a.slots), a.slots}):
            profiles.append(profile_report(eng, slots[:n], toks[:n], a.top))

    res = {
        "adapter": info.get("adapter"),
        "unchecked_shaders": info.get("unchecked_shaders"),
        "model": a.model,
        "layers": info.get("n_layer"),
        "precise": a.precise,
        "route_inside_max_rows": a.route_inside_max_rows,
        "attention_walk": a.attention_walk,
        "dense_group_cols": a.dense_group_cols,
        "spin_wait_us": a.spin_wait_us,
        "weight_arena": info.get("weight_arena"),
        "armed_steps": info.get("armed_steps"),
        "tensor_core_decode_cols": info.get("tensor_core_decode_cols"),
        "decode_shapes": a.decode_shape,
        "load_s": round(load_s, 2),
        "prefill_tokens": a.prompt,
        "prefill_tok_s": round(a.prompt / prefill_s, 1),
        "decode_ms_per_token": round(1000 * step_s, 3),
        "decode_tok_s": round(1 / step_s, 1),
        "decode_host": timing,
        "decode_chained_ms_per_token": round(1000 * chained_s, 3),
        "decode_chained_tok_s": round(1 / chained_s, 1),
        "chained_tokens_identical": chained == fed,
        "decode_at_depth": depth,
        "long_prefill": long,
        "slots": a.slots,
        "prefill_rows": info["prefill_rows"],
        "multi_slot_aggregate_tok_s": round(a.slots / multi_s, 1),
        "multi_slot_chained_tok_s": round(a.slots / multi_chained_s, 1),
        "scheduler_aggregate_tok_s": through_scheduler,
        "counters": eng.counters(),
    }
    if a.profile:
        # Prefill pieces on slot 0 from position 0: a full engine piece (what a long prompt is made
        # of) and one 64-token DeltaNet chunk; each profiled call runs once unprofiled first, so the
        # profile holds no pipeline compilation.
        for n in sorted({min(info["prefill_rows"], len(tokens)), min(64, len(tokens))}, reverse=True):
            eng.stage_run(0, tokens[:n], 0)
            prof = eng.profile_stage_run(0, tokens[:n], 0)
            profiles.append(print_profile(prof, f"prefill piece: {n} tokens", a.top))
        res["profile"] = profiles
    print(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
