"""Scheduler with the fake engine, no HTTP: FIFO admission beyond the slot count, multi-slot decode
steps, interleaved sequences equal their single-sequence references, cancellation frees the slot
within a step, queue limit, prompt-too-long, engine errors end every job exactly once, drain. The
scheduler uses a driver only through the ``Driver`` contract, and keeps a pipelined driver's lanes
in flight."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest
from fake_engine import FakeDeviceLost, FakeEngine
from qk.driver import Driver, LocalDriver, Next
from qk.sampler import SamplingParams
from qk.scheduler import (
    PREFILL_CHUNK,
    Failed,
    Finished,
    GenerationRequest,
    PromptTooLongError,
    QueueFullError,
    Scheduler,
    ShuttingDownError,
    Token,
)

VOCAB = 300


def make(slots=2, ctx=2048, max_queue=16, **engine_kwargs):
    engine = FakeEngine(VOCAB, slots=slots, ctx=ctx, **engine_kwargs)
    scheduler = Scheduler(
        lambda: LocalDriver(engine),
        slots=slots,
        ctx=ctx,
        max_queue=max_queue,
        device_lost_errors=(FakeDeviceLost,),
    )
    scheduler.start()
    return engine, scheduler


async def ready(scheduler: Scheduler) -> None:
    for _ in range(1000):
        if scheduler.state == "ready":
            return
        await asyncio.sleep(0.001)
    raise TimeoutError(scheduler.state)


async def run_job(job) -> tuple[list[int], object]:
    tokens = []
    while True:
        event = await asyncio.wait_for(job.next_event(), 10)
        if isinstance(event, Token):
            tokens.append(event.id)
        else:
            return tokens, event


def request(prompt, n=8, **params):
    return GenerationRequest(list(prompt), n, SamplingParams(**params))


def reference(prompt, n) -> list[int]:
    """Greedy continuation by the fake model alone, one sequence."""
    engine = FakeEngine(VOCAB, slots=1)
    ids, _ = engine.stage_run(0, list(prompt), 0)
    out = [ids[-1]]
    while len(out) < n:
        (([token], _),) = engine.step([0], [out[-1]])
        out.append(token)
    return out


def test_interleaved_sequences_match_references_and_share_steps():
    async def main():
        engine, scheduler = make(slots=3)
        await ready(scheduler)
        prompts = [[1, 2, 3], [4, 5, 6, 7], [8] * 20, [9, 10], [11, 12, 13]]
        jobs = [scheduler.submit(request(p, 12)) for p in prompts]
        results = await asyncio.gather(*(run_job(j) for j in jobs))
        for prompt, (tokens, end) in zip(prompts, results, strict=True):
            assert tokens == reference(prompt, 12) and end == Finished("length")
        steps = [c[1] for c in engine.calls if c[0] == "step"]
        # With 5 requests on 3 slots, decode steps advance several slots at once.
        assert max(len(s) for s in steps) == 3
        assert scheduler.drain(5)

    asyncio.run(main())


def test_fifo_admission_beyond_slots():
    async def main():
        engine, scheduler = make(slots=1)
        engine.gate.clear()
        await ready(scheduler)
        # Prompt lengths 1..5 identify the requests in the engine's call log.
        jobs = [scheduler.submit(request(range(1, n + 1), 3)) for n in range(1, 6)]
        engine.gate.set()
        await asyncio.gather(*(run_job(j) for j in jobs))
        prefills = [c[1] for c in engine.calls if c[0] == "stage_run"]
        # One slot: the prompts were prefilled in submission order, each after the previous ended.
        assert [p[1] for p in prefills] == [1, 2, 3, 4, 5]
        order = [job.prefill_started_at for job in jobs]
        assert order == sorted(order)
        scheduler.drain(5)

    asyncio.run(main())


def test_cancel_frees_slot_within_one_step():
    async def main():
        engine, scheduler = make(slots=1, step_delay=0.002)
        await ready(scheduler)
        long_job = scheduler.submit(request([1, 2], 100000))
        while not isinstance(await long_job.next_event(), Token):
            pass
        steps_before = sum(c[0] == "step" for c in engine.calls)
        long_job.cancel()
        scheduler.wake()
        tokens, end = await run_job(long_job)
        assert end == Finished("cancelled")
        # Tokens already in flight when cancel() was called: at most one more step ran.
        assert sum(c[0] == "step" for c in engine.calls) - steps_before <= 2
        nxt = scheduler.submit(request([3], 2))
        assert (await run_job(nxt))[1] == Finished("length")
        scheduler.drain(5)

    asyncio.run(main())


def test_limits_and_admission_errors():
    async def main():
        engine, scheduler = make(slots=1, ctx=64, max_queue=1)
        engine.gate.clear()
        await ready(scheduler)
        with pytest.raises(PromptTooLongError, match=r"prompt is too long: 64 tokens > 63 maximum"):
            scheduler.submit(request(range(64)))
        a = scheduler.submit(request([1], 2))
        b = scheduler.submit(request([2], 2))
        with pytest.raises(QueueFullError):
            scheduler.submit(request([3], 2))
        engine.gate.set()
        assert (await run_job(a))[1] == Finished("length")
        assert (await run_job(b))[1] == Finished("length")
        # Context full ends generation with "length" before the engine would overflow.
        tokens, end = await run_job(scheduler.submit(request(range(1, 60), None)))
        assert end == Finished("length") and len(tokens) == 64 - 59
        scheduler.drain(5)
        with pytest.raises(ShuttingDownError):
            scheduler.submit(request([1], 1))

    asyncio.run(main())


def test_stop_ids_end_generation():
    async def main():
        _, scheduler = make(slots=1)
        await ready(scheduler)
        ref = reference([5, 6, 7], 10)
        stop = ref[4]
        first = ref.index(stop)
        tokens, end = await run_job(
            scheduler.submit(GenerationRequest([5, 6, 7], 10, stop_ids=frozenset({stop})))
        )
        assert tokens == ref[:first] and end == Finished("stop", stop)
        scheduler.drain(5)

    asyncio.run(main())


def test_long_prompt_prefills_in_aligned_chunks():
    async def main():
        engine, scheduler = make(slots=1, ctx=4096)
        await ready(scheduler)
        prompt = [(i * 7) % VOCAB for i in range(PREFILL_CHUNK * 2 + 10)]
        tokens, _ = await run_job(scheduler.submit(request(prompt, 4)))
        bases = [c[1][2] for c in engine.calls if c[0] == "stage_run"]
        assert bases == [0, PREFILL_CHUNK, 2 * PREFILL_CHUNK] and PREFILL_CHUNK % 64 == 0
        assert tokens == reference(prompt, 4)
        scheduler.drain(5)

    asyncio.run(main())


def test_a_prompt_alone_prefills_in_the_engines_pieces_and_beside_decoding_jobs_in_chunks():
    async def main():
        engine, scheduler = make(slots=2, ctx=8192, prefill_rows=1024, step_delay=0.002)
        await ready(scheduler)
        prompt = [(i * 7) % VOCAB for i in range(2600)]
        # Alone: the engine's 1024-row pieces (the time to first token is all that waits).
        tokens, _ = await run_job(scheduler.submit(request(prompt, 4)))
        assert tokens == reference(prompt, 4)
        bases = [c[1][2] for c in engine.calls if c[0] == "stage_run"]
        assert bases == [0, 1024, 2048]
        engine.calls.clear()
        # Beside a job that decodes: chunks of PREFILL_CHUNK, so its steps interleave.
        talker = scheduler.submit(request([9, 8, 7], 400))
        while not any(c[0] != "stage_run" for c in engine.calls):
            await asyncio.sleep(0.001)
        tokens, _ = await run_job(scheduler.submit(request(prompt, 4)))
        assert tokens == reference(prompt, 4)
        bases = [c[1][2] for c in engine.calls if c[0] == "stage_run" and c[1][1] > 3]
        assert bases == list(range(0, 2600, PREFILL_CHUNK))
        await run_job(talker)
        scheduler.drain(5)

    asyncio.run(main())


def test_engine_error_fails_jobs_once_and_device_lost_stops():
    async def main():
        engine, scheduler = make(slots=2)
        await ready(scheduler)
        engine.fail_with = ValueError("kernel exploded")
        _, end = await run_job(scheduler.submit(request([1], 3)))
        assert isinstance(end, Failed) and isinstance(end.error, ValueError)
        engine.fail_with = None
        assert (await run_job(scheduler.submit(request([1], 3))))[1] == Finished("length")
        engine.fail_with = FakeDeviceLost("lost")
        jobs = [scheduler.submit(request([i + 1], 50)) for i in range(3)]
        ends = [(await run_job(j))[1] for j in jobs]
        assert all(isinstance(e, Failed) and isinstance(e.error, FakeDeviceLost) for e in ends)
        assert scheduler.state == "device_lost" and not scheduler.ready
        for job in jobs:
            assert job.queue.empty()  # exactly one terminal event each
        assert sum(scheduler.stats.finished.values()) == 5

    asyncio.run(main())


def test_sampled_requests_are_seeded():
    async def main():
        _, scheduler = make(slots=2)
        await ready(scheduler)
        params = dict(temperature=1.0, top_k=50, seed=11)
        a, b = await asyncio.gather(
            run_job(scheduler.submit(request([1, 2], 16, **params))),
            run_job(scheduler.submit(request([1, 2], 16, **params))),
        )
        assert a[0] == b[0] and a[0] != reference([1, 2], 16)
        scheduler.drain(5)

    asyncio.run(main())


def test_sampled_request_logs_slot_temperature_top_p_seed(caplog):
    async def main():
        _, scheduler = make(slots=1)
        await ready(scheduler)
        with caplog.at_level("INFO", logger="qk.scheduler"):
            await run_job(scheduler.submit(request([1], 2, temperature=0.7, top_p=0.9, seed=1234)))
            await run_job(scheduler.submit(request([1], 2)))
        scheduler.drain(5)

    asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if "seed" in r.getMessage()]
    # One line for the sampled request, none for the greedy one.
    assert len(lines) == 1 and all(
        s in lines[0] for s in ("slot 0", "temperature 0.7", "top_p 0.9", "seed 1234")
    )


#: Every name of the driver contract (qk.driver.Driver): all the scheduler may touch.
CONTRACT = {name for name in dir(Driver) if not name.startswith("_") or name in Driver.__annotations__} | set(
    Driver.__annotations__
)


class Recording(LocalDriver):
    """A local driver that records every attribute the scheduler reads of it."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.read: set[str] = set()
        self.closed = 0

    def __getattribute__(self, name: str):
        if not name.startswith("__") and name not in ("read", "closed", "engine"):
            object.__getattribute__(self, "read").add(name)
        return object.__getattribute__(self, name)

    def close(self) -> None:
        self.closed += 1


def test_the_scheduler_uses_a_driver_only_through_its_contract():
    async def main():
        engine = FakeEngine(VOCAB, slots=2)
        engine.state_save = lambda slot, idx: None
        engine.state_load = lambda slot, idx: None
        engine.state_drop = lambda idx: None
        driver = Recording(engine)
        from qk.scheduler import ReuseSettings

        scheduler = Scheduler(lambda: driver, slots=2, ctx=512, reuse=ReuseSettings(max_entries=2))
        scheduler.start()
        await ready(scheduler)
        prompts = [[1] * 70, [2, 3]]
        results = await asyncio.gather(
            *(run_job(scheduler.submit(GenerationRequest(p, 4, history=len(p)))) for p in prompts)
        )
        assert [r[0] for r in results] == [reference(p, 4) for p in prompts]
        scheduler.invalidate_reuse()
        await run_job(scheduler.submit(request([4], 2)))
        assert scheduler.drain(5)
        # Read: what serving needs (prefill, decode_async, chains, snapshots, close, ...); nothing
        # outside the contract, so no capability is probed.
        assert driver.read <= CONTRACT, driver.read - CONTRACT
        assert {"prefill", "decode_async", "chains", "supports_snapshots", "on_state_lost"} <= driver.read
        assert driver.closed == 1

    asyncio.run(main())


class Pipelined(LocalDriver):
    """Steps that finish only when collected, on another thread, as a split chain's do: at most
    ``lanes`` of them may be in flight, and each group's tokens must come back in order."""

    chains = False

    def __init__(self, engine, lanes: int) -> None:
        super().__init__(engine)
        self.lanes = lanes
        self.in_flight = 0
        self.most_in_flight = 0
        self.lost: list = []

    def decode_async(self, slots: Sequence[int], tokens: Sequence[int], topk: int, chain_next: bool = False):
        driver = self
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        done = threading.Event()
        out: list[list[Next]] = []

        def run() -> None:
            out.append(LocalDriver.decode(driver, slots, tokens, topk))
            done.set()

        threading.Thread(target=run).start()

        class Step:
            def done(self) -> bool:
                return False  # never collected before the scheduler has nothing else to do

            def result(self) -> list[Next]:
                done.wait(5)
                driver.in_flight -= 1
                return out[0]

        return Step()

    def on_state_lost(self, callback) -> None:
        self.lost.append(callback)


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_pipelined_driver_keeps_its_lanes_in_flight(lanes):
    async def main():
        engine = FakeEngine(VOCAB, slots=3)
        driver = Pipelined(engine, lanes)
        scheduler = Scheduler(lambda: driver, slots=3, ctx=512)
        scheduler.start()
        await ready(scheduler)
        prompts = [[1, 2], [3, 4, 5], [6]]
        results = await asyncio.gather(*(run_job(scheduler.submit(request(p, 10))) for p in prompts))
        assert [r[0] for r in results] == [reference(p, 10) for p in prompts]
        assert driver.most_in_flight == lanes
        # A lost chain session voids the reuse table: the scheduler asked to be told.
        assert driver.lost == [scheduler.invalidate_reuse]
        assert scheduler.drain(5)

    asyncio.run(main())


def test_greedy_steps_chain_on_the_engine_and_change_no_token():
    """An unchanged greedy batch has its next step submitted with its tokens fed by the engine
    (chained); every token still equals the one-sequence reference, a job that stops (or reaches
    its limit) while a chained step of it is queued ends exactly there, and the slot's next job is
    unaffected by that wasted step."""

    async def main():
        engine, scheduler = make(slots=2)
        await ready(scheduler)
        ref = reference([5, 6, 7], 30)
        stop = ref[12]
        jobs = [
            scheduler.submit(GenerationRequest([5, 6, 7], 30, stop_ids=frozenset({stop}))),
            scheduler.submit(request([1, 2], 25)),
            scheduler.submit(request([3, 4, 5, 6], 9)),
        ]
        results = await asyncio.gather(*(run_job(j) for j in jobs))
        assert results[0] == (ref[: ref.index(stop)], Finished("stop", stop))
        assert results[1] == (reference([1, 2], 25), Finished("length"))
        # Admitted into the slot the stopped job left (a chained step of that job ran meanwhile).
        assert results[2] == (reference([3, 4, 5, 6], 9), Finished("length"))
        assert engine.chained_steps >= 10
        chained = engine.chained_steps
        # Sampled requests take their tokens from the host sampler: never chained.
        await run_job(scheduler.submit(request([1, 2], 12, temperature=1.0, seed=3)))
        assert engine.chained_steps == chained
        scheduler.drain(5)

    asyncio.run(main())


def test_chaining_stops_short_of_the_context():
    async def main():
        engine, scheduler = make(slots=1, ctx=40)
        await ready(scheduler)
        tokens, end = await run_job(scheduler.submit(request(range(1, 21), None)))
        # 20 prompt positions, then tokens until the context is full; no step past it was queued.
        assert end == Finished("length") and len(tokens) == 40 - 20
        assert tokens == reference(range(1, 21), 20) and engine.chained_steps > 0
        scheduler.drain(5)

    asyncio.run(main())
