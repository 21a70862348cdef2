"""qk.split.SplitDriver over a real qk._qk.HeadLink to qk._qk.Worker chains serving the test-double
stages of test_split_link: prefill pieces stream down the chain while the head computes (the worker's
first frame lands before the head finishes), results equal the composed stages whatever the cuts,
pipelined decode lanes equal sequential stepping, snapshots go to every stage, and a new session
(a restarted worker) voids the scheduler's reuse table."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

_qk = pytest.importorskip("qk._qk")
from qk.scheduler import Finished, GenerationRequest, ReuseSettings, Scheduler, Token  # noqa: E402
from qk.split import SplitDriver, _Step, pieces  # noqa: E402
from test_split_link import N_EMBD, N_LAYER, DoubleStage, Serving  # noqa: E402


class Damped(DoubleStage):
    """DoubleStage with a bounded recurrence, so prompts of hundreds of positions stay finite."""

    def _rows(self, tokens, hidden) -> np.ndarray:
        rows = super()._rows(tokens, hidden)
        return rows / np.float32(1000) if tokens is not None else rows

    def _advance(self, slot: int, base: int, rows: np.ndarray) -> np.ndarray:
        time.sleep(self.delay)
        if base == 0:
            self.slots[slot] = (0, np.zeros(N_EMBD, dtype=np.float32))
        pos, acc = self.slots[slot]
        if pos != base:
            raise ValueError(f"base {base}, but slot {slot} is at {pos}")
        out = []
        for row in rows:
            row = row.astype(np.float32)
            for layer in range(self.info["layer_first"], self.info["layer_end"]):
                acc = (acc * np.float32(0.5) + row).astype(np.float32)
                row = np.tanh(row * np.float32(0.5) + np.float32(layer / 10) + acc * np.float32(0.25))
            out.append(row.astype(np.float32))
        self.slots[slot] = (pos + len(rows), acc)
        return np.stack(out)


class HeadEngine:
    """A test-double stage as a split head's engine: its stage methods (the head's pipeline calls
    them, through the bindings) plus the ``info()`` a driver reads, recording when each run ran."""

    def __init__(self, stage: DoubleStage) -> None:
        self.stage = stage
        self.calls: list[tuple[str, float, float]] = []

    def __getattr__(self, name: str):
        # describe, step, position, save, load, drop, reset: the stage's own.
        return getattr(self.stage, name)

    def run(self, slot, base, tokens, hidden, topk):
        start = time.monotonic()
        out = self.stage.run(slot, base, tokens, hidden, topk)
        self.calls.append(("run", start, time.monotonic()))
        return out

    def info(self) -> dict:
        i = self.stage.info
        return {
            "layers": (i["layer_first"], i["layer_end"]),
            "n_layer": i["n_layer"],
            "n_embd": i["n_embd"],
            "slots": i["slots"],
            "ctx": i["ctx"],
            "adapter": "numpy",
            "memory": {"kv_per_slot": 1000, "deltanet_per_slot": 24},
        }

    def own(self, name: str, boot_id: int) -> dict:
        """The head's stage description for its link."""
        return {**self.stage.desc(name), "boot_id": boot_id}


class RecordingStage(Damped):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.arrivals: list[float] = []

    def run(self, slot, base, tokens, hidden, topk):
        self.arrivals.append(time.monotonic())
        return super().run(slot, base, tokens, hidden, topk)


class Composed:
    """The reference: the same stage cuts composed in one process (a stage keeps its own state, so
    the composition, not one 6-layer stage, is what the chain must equal)."""

    def __init__(self, cuts: list[int]) -> None:
        self.stages = [Damped(a, b) for a, b in zip(cuts, cuts[1:], strict=False)]

    def run(self, slot: int, base: int, tokens: list[int], topk: int = 0):
        rows = self.stages[0].run(slot, base, tokens, None, 0)
        for stage in self.stages[1:-1]:
            rows = stage.run(slot, base, None, rows, 0)
        return self.stages[-1].run(slot, base, None, rows, topk)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        ids, _ = self.run(0, 0, prompt)
        out = [ids[-1]]
        while len(out) < n:
            ids, _ = self.run(0, len(prompt) + len(out) - 1, [out[-1]])
            out.append(ids[-1])
        return out


@pytest.fixture()
def chain():
    """Head [0, 2) here; workers [2, 4) and [4, 6) in this process, one socket hop each."""
    tail = Serving(RecordingStage(4, N_LAYER), "tail")
    mid = Serving(RecordingStage(2, 4), "mid", next=tail.addr)
    head = HeadEngine(Damped(0, 2))
    link = _qk.HeadLink(mid.addr, head.own("head", 7), connect_timeout=2.0, hello_timeout=10.0)
    driver = SplitDriver(head, link, target=mid.addr, piece=64, ticker=False)
    yield driver, head, mid, tail
    driver.close()
    mid.stop()
    tail.stop()


def test_pieces_cut_at_absolute_multiples():
    assert pieces(0, 130, 64) == [(0, 64), (64, 64), (128, 2)]
    assert pieces(100, 40, 64) == [(0, 28), (28, 12)]
    assert pieces(128, 64, 64) == [(0, 64)]
    assert pieces(5, 0, 64) == []


def test_prefill_streams_to_the_next_stage_before_the_head_is_done(chain):
    driver, head, mid, _ = chain
    head.stage.delay = 0.05  # the head's layers take time, as on a real GPU
    prompt = [int(x) for x in np.random.default_rng(1).integers(0, 900, 300)]
    nxt = driver.prefill(0, prompt, 0, 3)
    assert len(head.calls) == 5  # 300 positions in pieces of 64
    head_done = head.calls[-1][2]
    assert mid.stage.arrivals[0] < head_done, "the chain waited for the whole prefill"
    ids, top = Composed([0, 2, 4, N_LAYER]).run(0, 0, prompt, 3)
    assert nxt.token == ids[-1] and nxt.candidates == top


def test_pipelined_lanes_equal_sequential(chain):
    driver, _, _, _ = chain
    prompts = [[5, 6, 7, 8], [900, 1, 2], [3] * 70]
    firsts = [driver.prefill(s, p, 0, 0).token for s, p in enumerate(prompts)]
    out = [[f] for f in firsts]
    for _ in range(6):
        # Two groups in flight at once, as the scheduler's lanes do.
        a = driver.decode_async([0, 2], [out[0][-1], out[2][-1]], 0)
        b = driver.decode_async([1], [out[1][-1]], 0)
        (n0, n2), (n1,) = a.result(), b.result()
        out[0].append(n0.token), out[1].append(n1.token), out[2].append(n2.token)
    for p, got in zip(prompts, out, strict=True):
        assert got == Composed([0, 2, 4, N_LAYER]).greedy(p, 7)


def test_snapshots_go_to_every_stage(chain):
    driver, head, mid, tail = chain
    driver.prefill(1, [1, 2, 3, 4], 0, 0)
    driver.save_state(1, 2)
    assert 2 in head.stage.snapshots and 2 in mid.stage.snapshots and 2 in tail.stage.snapshots
    driver.prefill(1, [9, 9], 0, 0)
    driver.load_state(1, 2)
    got = driver.prefill(1, [5], 4, 0).token
    assert got == Composed([0, 2, 4, N_LAYER]).greedy([1, 2, 3, 4, 5], 1)[0]
    driver.drop_state(2)
    assert 2 not in tail.stage.snapshots


def test_chained_steps_feed_the_chains_greedy_ids(chain):
    """A chained step runs the head on the ids the chain answered for the step before (on the link
    thread): the same tokens as feeding them back by hand; any other call between ends the chain."""
    driver, _, _, _ = chain
    assert driver.chains
    prompts = [[5, 6, 7, 8], [900, 1, 2]]
    firsts = [driver.prefill(s, p, 0, 0).token for s, p in enumerate(prompts)]
    out = [[f] for f in firsts]
    pending = driver.decode_async([0, 1], firsts, 0)
    for _ in range(5):
        # Queued before the one it follows is collected, as the scheduler does.
        nxt = driver.decode_chained(pending, 0)
        for o, n in zip(out, pending.result(), strict=True):
            o.append(n.token)
        pending = nxt
    for o, n in zip(out, pending.result(), strict=True):
        o.append(n.token)
    for p, got in zip(prompts, out, strict=True):
        assert got == Composed([0, 2, 4, N_LAYER]).greedy(p, 7)
    # A snapshot between a step and its chained successor: the successor fails, cleanly.
    pending = driver.decode_async([0, 1], [out[0][-1], out[1][-1]], 0)
    pending.result()
    driver.save_state(0, 1)
    with pytest.raises(Exception, match="chained step follows"):
        driver.decode_chained(pending, 0).result()
    # Over other slots: the same.
    pending = driver.decode_async([0], [5], 0)
    with pytest.raises(Exception, match="chained step follows"):
        driver.decode_chained(_Step(driver, pending._pending, [1], 0), 0).result()


def test_a_two_lane_split_does_not_chain():
    tail = Serving(Damped(3, N_LAYER), "tail")
    head = HeadEngine(Damped(0, 3))
    link = _qk.HeadLink(tail.addr, head.own("head", 7), connect_timeout=2.0, hello_timeout=10.0)
    driver = SplitDriver(head, link, target=tail.addr, piece=64, ticker=False, lanes=2)
    try:
        assert not driver.chains
        first = driver.prefill(0, [1, 2, 3], 0, 0).token
        pending = driver.decode_async([0], [first], 0)
        with pytest.raises(ValueError, match="one lane"):
            driver.decode_chained(pending, 0)
        pending.result()
    finally:
        driver.close()
        tail.stop()


def test_scheduler_chains_greedy_steps_through_a_one_lane_split():
    tail = Serving(Damped(3, N_LAYER), "tail")
    head = HeadEngine(Damped(0, 3))
    link = _qk.HeadLink(tail.addr, head.own("head", 7), connect_timeout=2.0, hello_timeout=10.0)
    driver = SplitDriver(head, link, target=tail.addr, piece=64, ticker=False)
    chained = []
    plain = driver.decode_chained

    def counting(after, topk):
        chained.append(topk)
        return plain(after, topk)

    driver.decode_chained = counting
    scheduler = Scheduler(lambda: driver, slots=2, ctx=256)
    scheduler.start()
    try:
        while scheduler.state == "loading":
            time.sleep(0.01)
        prompts = [[7] * 70, [8] * 90]
        got = run_jobs(scheduler, [GenerationRequest(p, max_tokens=8) for p in prompts])
        assert got == [Composed([0, 3, N_LAYER]).greedy(p, 8) for p in prompts]
        assert chained, "no step was chained"
        assert scheduler.drain(10)
    finally:
        scheduler.drain(5)
        driver.close()
        tail.stop()


def run_jobs(scheduler: Scheduler, requests: list[GenerationRequest]) -> list[list[int]]:
    async def one(req):
        job = scheduler.submit(req)
        out = []
        while True:
            ev = await job.next_event()
            if isinstance(ev, Token):
                out.append(ev.id)
            elif isinstance(ev, Finished):
                return out
            else:
                return None

    async def all_of():
        return await asyncio.gather(*(one(r) for r in requests))

    return asyncio.run(all_of())


def test_scheduler_lanes_and_a_restarted_worker_voids_reuse():
    tail_stage = RecordingStage(3, N_LAYER)
    tail = Serving(tail_stage, "tail")
    head = HeadEngine(Damped(0, 3))
    own = head.own("head", 7)
    link = _qk.HeadLink(tail.addr, own, connect_timeout=2.0, hello_timeout=10.0, backoff_min=0.05)
    driver = SplitDriver(head, link, target=tail.addr, piece=64, ticker=False, lanes=2)
    scheduler = Scheduler(lambda: driver, slots=2, ctx=256, reuse=ReuseSettings(max_entries=4))
    scheduler.start()
    try:
        while scheduler.state == "loading":
            time.sleep(0.01)
        assert scheduler.reuse is not None and scheduler.reuse.max_entries == 4
        prompts = [[7] * 70, [8] * 90]
        reqs = [GenerationRequest(p, max_tokens=5, history=len(p)) for p in prompts]
        got = run_jobs(scheduler, reqs)
        assert got == [Composed([0, 3, N_LAYER]).greedy(p, 5) for p in prompts]
        assert scheduler.stats.decode_steps > 4  # lanes: more, smaller steps than one batch
        assert scheduler.reuse.entries == 2
        # The worker restarts (new boot id): the next session voids the table.
        tail.stop()
        tail = Serving(RecordingStage(3, N_LAYER), "tail", port=int(tail.addr.rsplit(":", 1)[1]))
        invalidated = threading.Event()
        driver.on_state_lost(invalidated.set)
        again = run_jobs(scheduler, [GenerationRequest([7] * 70 + [1], max_tokens=3)])
        # The first call after the restart may fail on the dead connection; what matters is that
        # no wrong answer is given and the table is voided.
        if again[0]:
            assert again[0] == Composed([0, 3, N_LAYER]).greedy([7] * 70 + [1], 3)
        assert invalidated.wait(5)
        # Draining the scheduler ends the chain session cleanly.
        assert scheduler.drain(10)
        assert not link.is_up
    finally:
        scheduler.drain(5)
        driver.close()
        tail.stop()
