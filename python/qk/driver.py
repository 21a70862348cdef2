"""The scheduler's view of a forward pass: ``Driver``, everything the scheduler, the server and the
metrics use of one (docs/architecture.md "Driver contract"), and ``LocalDriver``, one whole-model
engine on this box. The split head's driver is ``qk.split.SplitDriver``.

``EngineLike`` states exactly what the local driver uses of ``qk.Engine``, so the native engine and
the test suite's fake plug in unchanged. Results come back normalised to ``Next``: the greedy id of
the last position plus its top-k ``(id, logit)`` pairs (empty unless asked for).

Example::

    driver = LocalDriver(qk.Engine("M.gguf", slots=4, ctx=32768))
    first = driver.prefill(slot=0, tokens=prompt_ids, base=0, topk=0)
    nexts = driver.decode([0, 1], [first.token, other_token], topk=40)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["Done", "Driver", "EngineLike", "Health", "LocalDriver", "Next", "Pending"]


@dataclass(frozen=True)
class Next:
    """What one position produced: the greedy id and, when asked, the top-k (id, logit) pairs."""

    token: int
    candidates: list[tuple[int, float]] = field(default_factory=list)


class Pending(Protocol):
    """A decode step handed to a driver: ``result()`` waits for its ``Next`` per slot (once)."""

    def done(self) -> bool: ...

    def result(self) -> list[Next]: ...


class Done:
    """A decode step that already ran."""

    def __init__(self, nexts: list[Next]) -> None:
        self._nexts = nexts

    def done(self) -> bool:
        return True

    def result(self) -> list[Next]:
        return self._nexts


@dataclass(frozen=True)
class Health:
    """What ``/health`` and ``/metrics`` show of a driver; reading it never waits for the engine."""

    #: Why the driver cannot serve right now; None while it can.
    problem: str | None = None
    #: A split head's stages, the head first: {name, layers: [a, b] | None, adapter, up}. Empty on
    #: one box.
    stages: tuple[Mapping[str, Any], ...] = ()
    #: A split head's chain: {up, sessions, rtt_seconds, step_rtt_seconds, last_error, retry_in,
    #: taken_over}. None on one box.
    chain: Mapping[str, Any] | None = None


class Driver(Protocol):
    """What the scheduler drives, and all the server and the metrics read of it."""

    #: Groups of slots the scheduler keeps in flight at once: 1 batches every decoding slot into
    #: each step; 2 keeps one group on the head while the other is on the rest of a split chain.
    lanes: int

    #: Whether ``save_state``/``load_state``/``drop_state`` work (cross-turn reuse needs them).
    supports_snapshots: bool

    #: Whether ``decode_chained`` works (one box: the step's tokens can be fed on the GPU).
    chains: bool

    #: Positions per ``prefill`` call the driver runs at full speed (a multiple of 64): the
    #: scheduler sends this many while no other job decodes.
    prefill_rows: int

    def prefill(self, slot: int, tokens: Sequence[int], base: int, topk: int) -> Next: ...

    def decode_async(
        self, slots: Sequence[int], tokens: Sequence[int], topk: int, chain_next: bool = False
    ) -> Pending:
        """Start one decode step of several slots; its result is collected later.
        ``chain_next``: a chained step is likely to follow (a hint: it gets prepared ahead)."""
        ...

    def decode_chained(self, after: Pending, topk: int) -> Pending:
        """Start the decode step that follows ``after`` (not yet collected, nothing run since) over
        the same slots, each fed its greedy id from ``after``. Only where ``chains``."""
        ...

    def decode(self, slots: Sequence[int], tokens: Sequence[int], topk: int) -> list[Next]: ...

    def info(self) -> Mapping[str, Any]: ...

    def save_state(self, slot: int, idx: int) -> None: ...

    def load_state(self, slot: int, idx: int) -> None: ...

    def drop_state(self, idx: int) -> None: ...

    def on_state_lost(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from any thread) whenever every saved state was lost at once, as when
        a split chain starts a new session."""
        ...

    def health(self) -> Health: ...

    def close(self) -> None:
        """End what the driver holds open (a split head's chain session)."""
        ...


@runtime_checkable
class EngineLike(Protocol):
    """The part of ``qk.Engine`` (a whole-model engine: layers 0..n_layer) that serving uses.

    * ``stage_run(slot, tokens, base, topk=0, all_ids=True)`` runs positions
      ``[base, base + len(tokens))`` of ``slot`` (``base == 0`` resets it, any other base must
      equal the slot's position) and returns ``(ids, topk)``: the greedy id of every position (with
      ``all_ids=False``, of the final one alone), and the final position's top-k pairs.
    * ``step(slots, tokens, topk=0)`` runs one position for several slots in one pass and returns,
      per slot, a result in ``stage_run``'s shape: ``([greedy_id], topk)``.
    * ``step_submit(slots, tokens | None, topk=0, chain_next=False)`` starts such a step and
      returns its id; ``step_collect(id)`` waits for it and returns what ``step`` would. With
      ``tokens=None`` the step takes each slot's token from the previous submitted step over the
      same slots (its greedy id), before that one's results reach the host.
    * ``info()`` describes the model and the engine (``arch``, ``vocab``, ``slots``, ``ctx``, …).

    Engines that also have ``state_save(slot, idx)`` / ``state_load(slot, idx)`` / ``state_drop(idx)``
    (snapshots of a slot's whole state) make cross-turn reuse possible (qk.reuse).
    """

    def stage_run(
        self, slot: int, tokens: Sequence[int], base: int, topk: int = 0, all_ids: bool = True
    ) -> Any: ...

    def step(self, slots: Sequence[int], tokens: Sequence[int], topk: int = 0) -> Any: ...

    def step_submit(
        self, slots: Sequence[int], tokens: Sequence[int] | None, topk: int = 0, chain_next: bool = False
    ) -> int: ...

    def step_collect(self, id: int) -> Any: ...

    def info(self) -> Mapping[str, Any]: ...


def _pairs(topk: Any) -> list[tuple[int, float]]:
    """Top-k as a list of (id, logit): accepts a sequence of pairs or an ``(ids, logits)`` pair of
    arrays (NumPy in and out is the engine's Python face)."""
    if topk is None:
        return []
    if (
        isinstance(topk, tuple)
        and len(topk) == 2
        and hasattr(topk[0], "__len__")
        and hasattr(topk[1], "__len__")
    ):
        ids, logits = topk
        return [(int(i), float(x)) for i, x in zip(list(ids), list(logits), strict=True)]
    return [(int(i), float(x)) for i, x in topk]


def _last_id(ids: Any) -> int:
    """A step result's greedy id: qk.Engine returns each slot's result in stage_run's shape (a list
    of one id); a bare int is accepted too."""
    if isinstance(ids, int):
        return ids
    ids = list(ids)
    if len(ids) != 1:
        raise RuntimeError(f"step returned {len(ids)} ids for one position")
    return int(ids[0])


def _nexts(slots: Sequence[int], results: Any, topk: int) -> list[Next]:
    """A step's results (one ``([id], top-k)`` per slot) as ``Next``."""
    results = list(results)
    if len(results) != len(slots):
        raise RuntimeError(f"step returned {len(results)} results for {len(slots)} slots")
    return [Next(_last_id(ids), _pairs(top) if topk else []) for ids, top in results]


class _Step:
    """A decode step submitted to the engine: ``result()`` waits for it."""

    def __init__(
        self, driver: LocalDriver, engine: EngineLike, slots: list[int], step_id: int, topk: int
    ) -> None:
        self.driver = driver
        self.engine = engine
        self.slots = slots
        self.step_id = step_id
        self.topk = topk

    def done(self) -> bool:
        # Not known without waiting; the chained scheduler collects by age, not by this.
        return False

    def result(self) -> list[Next]:
        return _nexts(self.slots, self.engine.step_collect(self.step_id), self.topk)


class LocalDriver:
    """One engine holding every layer: prefill is ``stage_run``, decode is ``step_submit`` and
    ``step_collect``, with the next greedy step chained on the GPU behind the running one; one
    lane, nothing held open, no state lost but by the caller."""

    lanes = 1
    chains = True

    def __init__(self, engine: EngineLike) -> None:
        self.engine = engine
        # The engine's own prefill piece (2048 rows on a big GPU): one readback per call.
        self.prefill_rows = int(engine.info().get("prefill_rows", 512))
        self.supports_snapshots = all(
            callable(getattr(engine, name, None)) for name in ("state_save", "state_load", "state_drop")
        )

    def prefill(self, slot: int, tokens: Sequence[int], base: int, topk: int) -> Next:
        # Only the final position's id is served: the LM head skips the prompt's other rows.
        ids, top = self.engine.stage_run(slot, list(tokens), base, topk=topk, all_ids=False)
        ids = list(ids)
        if len(ids) != 1:
            raise RuntimeError(f"stage_run returned {len(ids)} ids for the final position")
        return Next(int(ids[-1]), _pairs(top) if topk else [])

    def decode_async(
        self, slots: Sequence[int], tokens: Sequence[int], topk: int, chain_next: bool = False
    ) -> Pending:
        slots = list(slots)
        step_id = self.engine.step_submit(slots, list(tokens), topk=topk, chain_next=chain_next)
        return _Step(self, self.engine, slots, step_id, topk)

    def decode_chained(self, after: Pending, topk: int) -> Pending:
        if not isinstance(after, _Step) or after.driver is not self:
            raise TypeError("decode_chained follows a step of this driver")
        step_id = self.engine.step_submit(after.slots, None, topk=topk, chain_next=True)
        return _Step(self, self.engine, after.slots, step_id, topk)

    def decode(self, slots: Sequence[int], tokens: Sequence[int], topk: int) -> list[Next]:
        return _nexts(slots, self.engine.step(list(slots), list(tokens), topk=topk), topk)

    def info(self) -> Mapping[str, Any]:
        return dict(self.engine.info())

    def save_state(self, slot: int, idx: int) -> None:
        self.engine.state_save(slot, idx)  # type: ignore[attr-defined]

    def load_state(self, slot: int, idx: int) -> None:
        self.engine.state_load(slot, idx)  # type: ignore[attr-defined]

    def drop_state(self, idx: int) -> None:
        self.engine.state_drop(idx)  # type: ignore[attr-defined]

    def on_state_lost(self, callback: Callable[[], None]) -> None:
        # The engine's snapshots go only when the scheduler drops them.
        pass

    def health(self) -> Health:
        return Health()

    def close(self) -> None:
        # The engine holds nothing open; its memory goes with the last reference.
        pass
