"""The head of a split model (docs/architecture.md "Split serving"): ``SplitDriver`` runs layers ``[0, A)`` on the
local engine and the rest through a ``qk._qk.HeadLink`` to the worker chain, behind the scheduler's
``Driver`` interface.

Two threads share the work so the pipeline is not idle half the time: the engine thread runs the
head's layers, and one link thread carries every call to the chain in order (qkp is strictly
request → reply per session, so one FIFO keeps each slot's positions in order on every stage). A
prompt is cut into pieces at absolute multiples of ``PIECE`` positions; each piece's hidden rows go
to the chain while the head computes the next one. ``decode_async`` returns a future, so the
scheduler can keep two groups of slots in flight (``lanes=2``): one on the head while the other is on
the chain.

A new link session (a reconnect) means every stage reset its slots and dropped its snapshots; the
driver then calls ``on_new_session`` (the scheduler voids its reuse table). A ticker thread pings the
chain while idle (round-trip time for /health and /metrics) and reconnects a down link with backoff.

Example::

    link = _qk.HeadLink("10.0.0.2:18100", own_stage, secret=b"...")
    driver = SplitDriver(_qk.Engine("M.gguf", layers=(0, 24), slots=4), link)
    first = driver.prefill(0, prompt_ids, 0, topk=0)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from qk.driver import Next, _pairs

__all__ = ["PIECE", "SplitDriver", "head_stage"]

log = logging.getLogger("qk.split")

#: Positions per piece sent down the chain during prefill: a multiple of 64 (the DeltaNet chunk), so
#: where the pieces are cut changes no result, and small enough that the next stage starts early.
PIECE = 128

#: Seconds between the ticker's looks at the link; a ping goes out only after this long idle.
TICK_S = 1.0
PING_IDLE_S = 5.0


def head_stage(engine: Any, fingerprint: str, snap_entries: int, name: str, boot_id: int) -> dict:
    """The head's own stage description for the hello (docs/protocol.md "Stage description"): the chain is checked
    against it (contiguous layers, same model, n_embd, enough slots and context)."""
    from qk.worker import stage_info

    return {"name": name, "boot_id": boot_id, **stage_info(engine, fingerprint, snap_entries)}


def pieces(base: int, n: int, piece: int = PIECE) -> list[tuple[int, int]]:
    """``[base, base + n)`` cut at absolute multiples of ``piece``: (start offset, length) pairs."""
    out = []
    pos, end = base, base + n
    while pos < end:
        stop = min(end, (pos // piece + 1) * piece)
        out.append((pos - base, stop - pos))
        pos = stop
    return out


class SplitDriver:
    """Layers ``[0, A)`` here, the rest on the chain behind ``link``."""

    supports_snapshots = True

    def __init__(
        self,
        engine: Any,
        link: Any,
        *,
        target: str = "next stage",
        piece: int = PIECE,
        lanes: int = 1,
        on_new_session: Callable[[], None] | None = None,
        ticker: bool = True,
    ) -> None:
        if piece % 64:
            raise ValueError(f"piece {piece} is not a multiple of 64")
        self.engine = engine
        self.link = link
        self.piece = piece
        if lanes < 1:
            raise ValueError("lanes must be at least 1")
        #: Groups of slots in flight at once (the scheduler reads it). One batches every slot into
        #: each step: the better choice when the stages share a device (measured on lavapipe: 1.40×
        #: single-stream for 2 slots against 0.74× with two lanes, benches/RESULTS.md). Two keep
        #: both ends busy when each stage has its own GPU.
        self.lanes = lanes
        self.target = target
        self.on_new_session = on_new_session
        from qk._qk import TransportError

        self._transport_error = TransportError
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qk-link")
        self._sessions: int | None = None
        self._session_lock = threading.Lock()
        self._last_activity = time.monotonic()
        #: Seconds of the latest ping through the whole chain (None until one succeeded).
        self.rtt: float | None = None
        #: Seconds of the latest decode step's round trip through the chain (head excluded).
        self.step_rtt: float | None = None
        # Layers and adapter never change; the engine's info() would wait for a step in progress.
        self._head_info = dict(engine.info())
        self._status: dict[str, Any] = {}
        self._refresh()
        self._closed = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="qk-link-ticker", daemon=True)
        if ticker:
            self._ticker.start()

    # -- the chain ---------------------------------------------------------------------------------

    def _refresh(self) -> None:
        """Copy the link's state into plain Python values for /health and /metrics: the link's own
        getters wait for an in-flight call, which must never stall the event loop."""
        self._status = {
            "up": bool(self.link.is_up),
            "sessions": int(self.link.sessions),
            "chain": [dict(s) for s in self.link.chain],
            "last_error": self.link.last_error,
            "retry_in": self.link.retry_in,
        }

    def _note_session(self) -> None:
        self._refresh()
        sessions = self._status["sessions"]
        with self._session_lock:
            previous, self._sessions = self._sessions, sessions
        if previous is not None and sessions != previous:
            restarted = list(self.link.take_restarted())
            log.warning(
                "new session with the chain%s: every stage reset its slots and snapshots",
                f" (restarted: {', '.join(restarted)})" if restarted else "",
            )
            if self.on_new_session is not None:
                self.on_new_session()

    def _submit(self, fn: Callable[..., Any], *args: Any, retry: bool = False, **kwargs: Any) -> Future:
        """Run a link call on the link thread. ``retry``: the call is safe to repeat on a new session
        (it starts a sequence at base 0, or restores a snapshot, which then fails cleanly), so a
        connection that died while idle (a restarted worker) costs no request."""

        def call() -> Any:
            self._last_activity = time.monotonic()
            try:
                try:
                    return fn(*args, **kwargs)
                except self._transport_error as first:
                    if not retry:
                        raise
                    log.info("retrying on a new session after: %s", first)
                    return fn(*args, **kwargs)
            except self._transport_error as exc:
                # The client sees this message (HTTP 503 / SSE error): say which part failed.
                raise self._transport_error(f"pipeline stage failed: {exc}") from exc
            finally:
                self._note_session()
                self._last_activity = time.monotonic()

        if self._closed.is_set():
            raise RuntimeError("this split driver is closed: make a new one for a new session")
        return self._pool.submit(call)

    def _tick(self) -> None:
        while not self._closed.wait(TICK_S):
            try:
                if not self.link.is_up:
                    if self.link.reconnect_if_due():
                        log.info("reconnected to the chain")
                        self._note_session()
                elif time.monotonic() - self._last_activity > PING_IDLE_S:
                    # Through the link thread, so a ping never interleaves with a slot's calls.
                    self.rtt = self._submit(self.link.ping).result()
            except Exception as exc:
                log.debug("link ticker: %s", exc)
            if not self._status["up"]:
                self._refresh()

    def connect(self) -> bool:
        """Try the chain now (start-up); False with a logged reason when it is not reachable yet."""
        try:
            self._submit(self.link.connect).result()
        except Exception as exc:
            log.warning("the chain is not reachable yet (%s); retrying in the background", exc)
            return False
        return True

    def close(self) -> None:
        self._closed.set()
        self._pool.shutdown(wait=True)
        self.link.close()

    # -- Driver -----------------------------------------------------------------------------------

    def prefill(self, slot: int, tokens: Sequence[int], base: int, topk: int) -> Next:
        tokens = list(tokens)
        futures: list[Future] = []
        try:
            for offset, n in pieces(base, len(tokens), self.piece):
                hidden = self.engine.stage_run(slot, tokens[offset : offset + n], base + offset)
                last = offset + n == len(tokens)
                start = base + offset
                futures.append(
                    self._submit(
                        self.link.run, slot, start, hidden=hidden, topk=topk if last else 0, retry=start == 0
                    )
                )
        finally:
            # Every piece sent is answered before this returns (or raises), so no reply is left
            # to land on a later request.
            results = []
            error: BaseException | None = None
            for future in futures:
                try:
                    results.append(future.result())
                except BaseException as exc:
                    error = error or exc
            if error is not None:
                raise error
        ids, top = results[-1]
        return Next(int(ids[-1]), _pairs(top) if topk else [])

    def decode_async(self, slots: Sequence[int], tokens: Sequence[int], topk: int) -> Future:
        """Run the head's layers for one position of each slot now; the returned future resolves
        to their ``Next`` once the chain has answered."""
        slots = [int(s) for s in slots]
        entries = [(s, int(self.engine.position(s))) for s in slots]
        rows = self.engine.step(slots, list(tokens))
        hidden = np.ascontiguousarray(np.concatenate(rows), dtype=np.float32)
        started = time.perf_counter()

        def step() -> list[Next]:
            ids, tops = self.link.step(entries, hidden=hidden, topk=topk)
            self.step_rtt = time.perf_counter() - started
            if len(ids) != len(slots):
                raise RuntimeError(f"the chain answered {len(ids)} ids for {len(slots)} slots")
            return [Next(int(i), _pairs(t) if topk else []) for i, t in zip(ids, tops, strict=True)]

        return self._submit(step)

    def decode(self, slots: Sequence[int], tokens: Sequence[int], topk: int) -> list[Next]:
        return self.decode_async(slots, tokens, topk).result()

    def save_state(self, slot: int, idx: int) -> None:
        self.engine.state_save(slot, idx)
        self._submit(self.link.save, slot, idx).result()

    def load_state(self, slot: int, idx: int) -> None:
        self.engine.state_load(slot, idx)
        self._submit(self.link.load, slot, idx, retry=True).result()

    def drop_state(self, idx: int) -> None:
        self.engine.state_drop(idx)
        # A down link needs no drop: the next session starts with every snapshot gone.
        if self._status["up"]:
            self._submit(self.link.drop, idx).result()

    def info(self) -> Mapping[str, Any]:
        info = dict(self.engine.info())
        chain = [dict(s) for s in self.link.chain]
        if chain:
            info["layers"] = (info["layers"][0], chain[-1]["layer_end"])
            info["snapshot_entries"] = int(self.link.snapshot_entries)
        return info

    def stages(self) -> list[dict[str, Any]]:
        """Each stage's state for /health and /metrics: the head first, then the chain (as of the
        latest link call; never waits for one in flight)."""
        head = self._head_info
        status = self._status
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

    def chain_status(self) -> dict[str, Any]:
        status = self._status
        return {
            "up": status["up"],
            "sessions": status["sessions"],
            "rtt_seconds": self.rtt,
            "step_rtt_seconds": self.step_rtt,
            "last_error": status["last_error"],
            "retry_in": status["retry_in"],
        }
