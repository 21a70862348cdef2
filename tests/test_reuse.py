"""Cross-turn reuse without a GPU: the prefix table (exact matches only, LRU within its entry and
byte bounds, invalidate), snapshot positions, the ``cch=`` stamp normalisation, and the scheduler
over a fake engine that can snapshot (reuse prefills only the unsaved rest and answers the same)."""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
from fake_engine import FakeEngine
from hypothesis import given
from hypothesis import strategies as st
from qk.driver import LocalDriver
from qk.reuse import (
    ReuseTable,
    normalise_billing_header,
    snapshot_position,
    state_bytes_from_info,
)
from qk.scheduler import Finished, GenerationRequest, ReuseSettings, Scheduler, Token

VOCAB = 300


def table(entries=4, budget=10_000, per_token=10):
    return ReuseTable(max_entries=entries, max_bytes=budget, state_bytes=lambda n: per_token * n)


def save(t: ReuseTable, prefix) -> int | None:
    r = t.reserve(prefix)
    if r is None:
        return None
    t.commit(r, prefix)
    return r.idx


def test_snapshot_position_is_64_aligned_and_leaves_a_position_to_run():
    assert snapshot_position(0, 10) == 0
    assert snapshot_position(63, 500) == 0
    assert snapshot_position(64, 500) == 64
    assert snapshot_position(200, 500) == 192
    # The history may reach the end of a prompt (/completion): the last position must still run.
    assert snapshot_position(128, 128) == 64
    assert snapshot_position(129, 129) == 128


def test_lookup_takes_the_longest_exact_prefix_and_never_a_mismatch():
    t = table()
    a = save(t, list(range(64)))
    b = save(t, list(range(128)))
    assert a is not None and b is not None and a != b
    hit = t.lookup(list(range(200)))
    assert hit is not None and hit.idx == b and len(hit.tokens) == 128
    # Differs inside the longer prefix: only the shorter one is a prefix.
    prompt = list(range(100)) + [999] + list(range(101, 200))
    hit = t.lookup(prompt)
    assert hit is not None and hit.idx == a
    # Differs in the first token: nothing.
    assert t.lookup([7] + list(range(1, 200))) is None
    # A prompt no longer than an entry cannot use it (one position must remain to run).
    assert t.lookup(list(range(64))) is None
    assert (t.stats.hits, t.stats.misses, t.stats.reused_tokens) == (2, 2, 192)


def test_saving_an_existing_prefix_is_a_no_op():
    t = table()
    assert save(t, [1] * 64) is not None
    assert t.reserve([1] * 64) is None
    assert t.entries == 1


def test_lru_eviction_by_entries():
    t = table(entries=2)
    first = save(t, [1] * 64)
    save(t, [2] * 64)
    t.lookup([1] * 65)  # first becomes the most recently used
    r = t.reserve([3] * 64)
    assert r is not None
    assert len(r.evict) == 1 and r.evict[0] != first
    t.commit(r, [3] * 64)
    assert t.entries == 2 and t.lookup([1] * 65) is not None and t.lookup([2] * 65) is None


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 40)), min_size=1, max_size=200))
def test_memory_bound_holds_under_many_conversations(conversations):
    # Fake-size model: 1 KiB fixed (recurrent state) + 100 B per position (KV rows).
    budget = 64 * 1024
    t = ReuseTable(max_entries=8, max_bytes=budget, state_bytes=lambda n: 1024 + 100 * n)
    live: set[int] = set()
    for conv, turns in conversations:
        prefix = [conv] * (64 * turns)
        r = t.reserve(prefix)
        if r is not None:
            assert set(r.evict) <= live
            live -= set(r.evict)
            t.commit(r, prefix)
            live.add(r.idx)
        assert t.bytes <= budget and t.entries <= 8
        # The table's account matches its own entries, and every live index is one the engine holds.
        assert t.bytes == sum(1024 + 100 * 64 * k for k in [len(e.tokens) // 64 for e in t._entries.values()])
        assert {e.idx for e in t._entries.values()} == live


def test_an_entry_larger_than_the_budget_is_not_saved():
    t = table(budget=100, per_token=10)
    assert t.reserve([1] * 64) is None and t.entries == 0


def test_invalidate_forgets_everything():
    t = table()
    old = {save(t, [1] * 64), save(t, [2] * 128)}
    assert set(t.invalidate()) == old
    assert t.entries == 0 and t.bytes == 0 and t.lookup([1] * 100) is None


def test_indices_stay_below_the_entry_count_and_a_failed_save_frees_its_index():
    # A split's workers hold exactly max_entries snapshot entries (qkp refuses other indices).
    t = ReuseTable(max_entries=3, max_bytes=1 << 30, state_bytes=lambda n: n)
    for i in range(20):
        idx = save(t, [i] * 64)
        assert 0 <= idx < 3
        assert len({e.idx for e in t._entries.values()}) == t.entries
    r = t.reserve([99] * 64)
    assert r is not None and len(r.evict) == 1
    t.release(r)
    again = t.reserve([98] * 64)
    assert again is not None and again.idx == r.idx and again.evict == []


def test_state_bytes_from_engine_info():
    # Per qk.Engine.info(): DeltaNet state is fixed per slot, KV is sized for ctx positions.
    size = state_bytes_from_info(
        {"ctx": 2048, "memory": {"kv_per_slot": 1048576, "deltanet_per_slot": 16896}}
    )
    assert size(0) == 16896
    assert size(256) == 16896 + 131072  # measured from the engine: a 256-position snapshot


def test_billing_header_stamp_is_normalised():
    a = "x-anthropic-billing-header: cc_version=2.1.3.abc; cc_entrypoint=cli; cch=ab12c;\nYou are Claude Code."
    b = "x-anthropic-billing-header: cc_version=2.1.3.abc; cc_entrypoint=cli; cch=93f0e;\nYou are Claude Code."
    assert normalise_billing_header(a) == normalise_billing_header(b)
    assert "cch=fffff;" in normalise_billing_header(a)
    assert normalise_billing_header(a).endswith("cli; cch=fffff;\nYou are Claude Code.")
    # Only that header line: the same text elsewhere is the user's and stays.
    plain = "please keep cch=ab12c; as is"
    assert normalise_billing_header(plain) == plain


class SnapshotEngine(FakeEngine):
    """The fake engine plus state snapshots (its whole state is the slot's history)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.snapshots: dict[int, tuple[list[int], object]] = {}
        self.prefilled = 0

    def info(self):
        return {**super().info(), "memory": {"kv_per_slot": 100 * self.ctx, "deltanet_per_slot": 1000}}

    def stage_run(self, slot, tokens, base, topk=0, all_ids=True):
        self.prefilled += len(tokens)
        return super().stage_run(slot, tokens, base, topk, all_ids)

    def state_save(self, slot, idx):
        self.snapshots[idx] = (list(self.history[slot]), copy.deepcopy(self._reply[slot]))

    def state_load(self, slot, idx):
        history, reply = self.snapshots[idx]
        self.history[slot] = list(history)
        self._reply[slot] = copy.deepcopy(reply)

    def state_drop(self, idx):
        del self.snapshots[idx]


async def run(scheduler: Scheduler, prompt: list[int], history: int) -> tuple[list[int], int]:
    job = scheduler.submit(GenerationRequest(prompt, 6, history=history))
    out = []
    while True:
        event = await job.next_event()
        if isinstance(event, Token):
            out.append(event.id)
        elif isinstance(event, Finished):
            return out, job.cached
        else:
            raise AssertionError(event)


def test_scheduler_reuses_the_history_prefix_and_answers_the_same():
    engine = SnapshotEngine(VOCAB, slots=1, ctx=2048)
    scheduler = Scheduler(
        lambda: LocalDriver(engine), slots=1, ctx=2048, reuse=ReuseSettings(max_entries=4, max_bytes=1 << 30)
    )
    scheduler.start()
    rng = np.random.default_rng(1)
    turn1 = [int(t) for t in rng.integers(0, VOCAB, 300)]
    turn2 = turn1[:290] + [int(t) for t in rng.integers(0, VOCAB, 50)]

    async def main():
        out1, cached1 = await run(scheduler, turn1, history=290)
        assert cached1 == 0 and engine.prefilled == 300
        assert [len(h) for h, _ in engine.snapshots.values()] == [256]  # 290 rounded down to 64
        # Prefill was cut at the snapshot position.
        assert [c[1][2] for c in engine.calls if c[0] == "stage_run"] == [0, 256]
        engine.prefilled = 0
        out2, cached2 = await run(scheduler, turn2, history=340)
        assert cached2 == 256 and engine.prefilled == len(turn2) - 256
        assert scheduler.reuse is not None and scheduler.reuse.stats.hits == 1
        scheduler.invalidate_reuse()
        engine.prefilled = 0
        again, cached = await run(scheduler, turn2, history=340)
        assert cached == 0 and engine.prefilled == len(turn2) and again == out2
        assert not set(engine.snapshots) - {e.idx for e in scheduler.reuse._entries.values()}

    asyncio.run(main())
    scheduler.drain(5)


def test_a_failing_snapshot_load_falls_back_to_a_full_prefill():
    engine = SnapshotEngine(VOCAB, slots=1, ctx=2048)
    scheduler = Scheduler(
        lambda: LocalDriver(engine), slots=1, ctx=2048, reuse=ReuseSettings(max_entries=4, max_bytes=1 << 30)
    )
    scheduler.start()
    prompt = list(range(200))

    async def main():
        first, _ = await run(scheduler, prompt, history=150)
        engine.snapshots.clear()  # the engine lost them (e.g. restarted) without the table knowing
        engine.prefilled = 0
        second, cached = await run(scheduler, prompt, history=150)
        assert cached == 0 and engine.prefilled == 200 and second == first
        assert scheduler.stats.reuse_errors == 1
        assert scheduler.reuse is not None and scheduler.reuse.stats.invalidations == 1

    asyncio.run(main())
    scheduler.drain(5)


@pytest.mark.parametrize("history", [0, 40])
def test_short_histories_save_nothing(history):
    engine = SnapshotEngine(VOCAB, slots=1, ctx=512)
    scheduler = Scheduler(lambda: LocalDriver(engine), slots=1, ctx=512, reuse=ReuseSettings())
    scheduler.start()
    asyncio.run(run(scheduler, list(range(100)), history=history))
    scheduler.drain(5)
    assert engine.snapshots == {}


def test_serve_flags():
    from qk.serve import parse_args

    args = parse_args(["--snapshots", "4", "--snapshot-gib", "0.5"])
    assert (args.snapshots, args.snapshot_gib, args.no_reuse) == (4, 0.5, False)
    assert parse_args(["--no-reuse", "--snapshots", "0"]).no_reuse
    with pytest.raises(SystemExit):
        parse_args(["--snapshots", "0"])
