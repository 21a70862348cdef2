"""The head of a split model (docs/architecture.md "Split serving"): ``SplitDriver`` is the scheduler's
``Driver`` over a ``qk._qk.SplitHead``, which runs layers ``[0, A)`` on the local engine and carries
their hidden rows to the worker chain behind a ``qk._qk.HeadLink`` without passing them through
Python: prompt pieces go down the chain while the head computes the next, and a decode step's
rows go from the head's readback into the qkp frame on the pipeline's link thread.

``decode_async`` returns as soon as the head's layers have run, so the scheduler can keep two groups
of slots in flight (``lanes=2``): one on the head while the other is on the chain.

A new link session (a reconnect) means every stage reset its slots and dropped its snapshots; the
driver then calls back whoever asked ``on_state_lost`` (the scheduler voids its reuse table). The
link thread looks after an idle link (reconnects with backoff, takes in a takeover notice, pings);
a watcher thread here logs what changed and notices new sessions between requests.

Example::

    link = _qk.HeadLink("10.0.0.2:18100", head_stage(engine, fingerprint, 16, "head", boot_id))
    driver = SplitDriver(_qk.Engine("M.gguf", layers=(0, 24), slots=4), link)
    first = driver.prefill(0, prompt_ids, 0, topk=0)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from qk.driver import Health, Next, Pending, _pairs

__all__ = ["PIECE", "SplitDriver", "head_stage"]

log = logging.getLogger("qk.split")

#: Positions per piece sent down the chain during prefill: a multiple of 64 (the DeltaNet chunk), so
#: where the pieces are cut changes no result, and small enough that the next stage starts early.
PIECE = 128

#: Seconds of idle after which the link thread looks after the link (and the watcher looks at it);
#: a ping goes out only after PING_IDLE_S idle.
TICK_S = 1.0
PING_IDLE_S = 5.0


def head_stage(engine: Any, fingerprint: str, snap_entries: int, name: str, boot_id: int) -> dict:
    """The head's own stage description for the hello (docs/protocol.md "Stage description"): the
    chain is checked against it (contiguous layers, same model, n_embd, enough slots and context)."""
    from qk._qk import EngineStage

    return {"name": name, "boot_id": boot_id, **EngineStage(engine, fingerprint, snap_entries).describe()}


def pieces(base: int, n: int, piece: int = PIECE) -> list[tuple[int, int]]:
    """``[base, base + n)`` cut at absolute multiples of ``piece``: (start offset, length) pairs —
    how the head cuts a prompt (the cut itself is made in Rust, ``split_head.rs``)."""
    out = []
    pos, end = base, base + n
    while pos < end:
        stop = min(end, (pos // piece + 1) * piece)
        out.append((pos - base, stop - pos))
        pos = stop
    return out


class _Step:
    """A decode step on the chain: ``result()`` gives each slot's ``Next`` once the chain answered."""

    def __init__(self, driver: SplitDriver, pending: Any, slots: list[int], topk: int) -> None:
        self._driver, self._pending, self.slots, self._topk = driver, pending, slots, topk
        self._n = len(slots)
        self._result: list[Next] | None = None

    def done(self) -> bool:
        return self._result is not None or bool(self._pending.done())

    def result(self) -> list[Next]:
        if self._result is None:
            try:
                ids, tops = self._pending.result()
            finally:
                self._driver._note_session()
            if len(ids) != self._n:
                raise RuntimeError(f"the chain answered {len(ids)} ids for {self._n} slots")
            self._result = [
                Next(int(i), _pairs(t) if self._topk else []) for i, t in zip(ids, tops, strict=True)
            ]
        return self._result


class SplitDriver:
    """Layers ``[0, A)`` here, the rest on the chain behind ``link``.

    ``engine`` is a ``qk.Engine`` (served natively, described by ``link``'s own stage) or, in tests,
    a Python stage object with an ``info()``. ``lanes``: groups of slots in flight at once. One
    batches every slot into each step: the better choice when the stages share a device (measured
    on lavapipe: 1.40× single-stream for 2 slots against 0.74× with two lanes, benches/RESULTS.md).
    Two keep both ends busy when each stage has its own GPU."""

    supports_snapshots = True

    def __init__(
        self,
        engine: Any,
        link: Any,
        *,
        target: str = "next stage",
        piece: int = PIECE,
        lanes: int = 1,
        ticker: bool = True,
    ) -> None:
        if piece % 64:
            raise ValueError(f"piece {piece} is not a multiple of 64")
        if lanes < 1:
            raise ValueError("lanes must be at least 1")
        from qk._qk import SplitHead

        self.engine = engine
        self.link = link
        self.lanes = lanes
        #: With one lane a greedy step may be chained: the link thread feeds the head the chain's
        #: greedy ids as soon as they arrive (two lanes keep two groups in flight instead).
        self.chains = lanes == 1
        # Pieces cross the link one by one: the chain's pieces stay at the scheduler's chunk.
        self.prefill_rows = 512
        self.target = target
        self.head = SplitHead(
            engine, link, piece=piece, tick=TICK_S if ticker else None, ping_idle=PING_IDLE_S
        )
        # Layers and adapter never change; the engine's info() would wait for a step in progress.
        self._head_info = dict(engine.info())
        self._listeners: list[Callable[[], None]] = []
        self._sessions: int | None = None
        self._session_lock = threading.Lock()
        self._seen: tuple[bool, str | None] = (False, None)
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="qk-link-watch", daemon=True)
        if ticker:
            self._watcher.start()

    # -- the chain ---------------------------------------------------------------------------------

    def _note_session(self) -> None:
        """A new session since the last look: every stage lost its slots and snapshots."""
        sessions = int(self.head.sessions)
        with self._session_lock:
            previous, self._sessions = self._sessions, sessions
        # The first session (from none) loses nothing.
        if previous and sessions != previous:
            restarted = list(self.head.take_restarted())
            log.warning(
                "new session with the chain%s: every stage reset its slots and snapshots",
                f" (restarted: {', '.join(restarted)})" if restarted else "",
            )
            for callback in list(self._listeners):
                callback()

    def _watch(self) -> None:
        """Log what the link thread found while idle, and notice a session it opened."""
        while not self._closed.wait(TICK_S):
            try:
                status = self.head.status()
                seen = (bool(status["up"]), status["taken_over"])
                if seen != self._seen:
                    up, taken = seen
                    if taken and taken != self._seen[1]:
                        log.warning("the chain ended this head's session: %s", taken)
                    elif up and not self._seen[0]:
                        log.info("connected to the chain")
                    elif not up and self._seen[0]:
                        log.warning("the chain is unreachable: %s", status["last_error"])
                    self._seen = seen
                self._note_session()
            except Exception as exc:
                log.debug("link watcher: %s", exc)

    def connect(self) -> bool:
        """Try the chain now (start-up); False with a logged reason when it is not reachable yet."""
        try:
            self.head.connect()
        except Exception as exc:
            log.warning("the chain is not reachable yet (%s); retrying in the background", exc)
            return False
        finally:
            self._note_session()
        return True

    def close(self) -> None:
        self._closed.set()
        self.head.close()

    # -- Driver -----------------------------------------------------------------------------------

    def prefill(self, slot: int, tokens: Sequence[int], base: int, topk: int) -> Next:
        try:
            ids, top = self.head.prefill(slot, list(tokens), base, topk)
        finally:
            self._note_session()
        return Next(int(ids[-1]), _pairs(top) if topk else [])

    def decode_async(
        self, slots: Sequence[int], tokens: Sequence[int], topk: int, chain_next: bool = False
    ) -> Pending:
        """Run the head's layers for one position of each slot now; the result resolves to their
        ``Next`` once the chain has answered. (``chain_next`` is a hint the head does not need.)"""
        slots = [int(s) for s in slots]
        pending = self.head.step(slots, [int(t) for t in tokens], topk)
        return _Step(self, pending, slots, topk)

    def decode_chained(self, after: Pending, topk: int) -> Pending:
        """The step after ``after`` (not collected, nothing run since) over its slots, each fed its
        greedy id: the head's layers run on the link thread as soon as the chain answers ``after``,
        without a round trip through the scheduler."""
        if not self.chains or not isinstance(after, _Step):
            raise ValueError("a chained step follows a step of this driver, with one lane")
        return _Step(self, self.head.step_chained(after.slots, topk), after.slots, topk)

    def decode(self, slots: Sequence[int], tokens: Sequence[int], topk: int) -> list[Next]:
        return self.decode_async(slots, tokens, topk).result()

    def save_state(self, slot: int, idx: int) -> None:
        try:
            self.head.save(slot, idx)
        finally:
            self._note_session()

    def load_state(self, slot: int, idx: int) -> None:
        try:
            self.head.load(slot, idx)
        finally:
            self._note_session()

    def drop_state(self, idx: int) -> None:
        try:
            self.head.drop(idx)
        finally:
            self._note_session()

    def on_state_lost(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    def info(self) -> Mapping[str, Any]:
        info = dict(self._head_info)
        status = self.head.status()
        if status["chain"]:
            info["layers"] = (info["layers"][0], status["chain"][-1]["layer_end"])
            info["snapshot_entries"] = int(status["snapshot_entries"])
        return info

    def stages(self, status: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """Each stage's state, the head first, then the chain as of the latest session."""
        status = self.head.status() if status is None else status
        head = self._head_info
        out = [{"name": "head", "layers": list(head["layers"]), "adapter": str(head["adapter"]), "up": True}]
        for stage in status["chain"]:
            out.append(
                {
                    "name": stage["name"],
                    "layers": [stage["layer_first"], stage["layer_end"]],
                    "adapter": stage["adapter"],
                    "up": status["up"],
                }
            )
        if not status["chain"]:
            out.append({"name": self.target, "layers": None, "adapter": None, "up": False})
        return out

    def health(self) -> Health:
        status = self.head.status()
        chain = {
            "up": status["up"],
            "sessions": status["sessions"],
            "rtt_seconds": status["ping_seconds"],
            "step_rtt_seconds": status["step_rtt_seconds"],
            "last_error": status["last_error"],
            "retry_in": status["retry_in"],
            "taken_over": status["taken_over"],
        }
        problem = None
        if status["taken_over"]:
            problem = f"this head lost the pipeline chain: {status['taken_over']}"
        elif not status["up"]:
            problem = f"a pipeline stage is unreachable: {status['last_error'] or 'not connected yet'}"
        return Health(problem=problem, stages=tuple(self.stages(status)), chain=chain)

    def step_times(self) -> dict[str, Any]:
        """Decode steps so far, summed: steps, rows, and the seconds spent on the head's layers,
        waiting for the link thread, and on the chain's round trip (benches/split_bench.py)."""
        return dict(self.head.status()["steps"])
