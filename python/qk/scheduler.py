"""Admission and continuous batching of generation requests over N engine slots.

One dedicated engine thread owns the driver (it loads the model, then runs every forward pass):
that thread and its queue are the single door between asyncio code and the blocking engine
(docs/architecture.md "Server layering"). Each loop turn it admits waiting jobs into free slots in FIFO order, runs one
prefill chunk of one admitted job, then one multi-slot decode step for every job already decoding
(so the weights are read once per step for all of them). Sampling happens here, on the head.

The async side submits a ``Job`` and reads its events (``Token``, ``Finished``, ``Failed``) from an
``asyncio.Queue``; ``Job.cancel()`` (client gone, stop string seen) frees the slot before the next
step. Every job ends with exactly one ``Finished`` or ``Failed``.

Cross-turn reuse (qk.reuse): a request says where its conversation history ends; prefill is cut
there (at the last multiple of 64 before it) and the slot's state saved, and a later request whose
prompt starts with a saved prefix loads that state and prefills only the rest.

Example::

    scheduler = Scheduler(load=lambda: LocalDriver(engine), slots=4, ctx=32768)
    scheduler.start()
    job = scheduler.submit(GenerationRequest(prompt_ids, max_tokens=64, stop_ids=eog_ids))
    while not isinstance(event := await job.next_event(), (Finished, Failed)):
        ...
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from qk.driver import Driver, Next, Pending
from qk.reuse import ReuseTable, snapshot_position, state_bytes_from_info
from qk.sampler import Sampler, SamplingParams

__all__ = [
    "DeviceUnavailableError",
    "EmptyPromptError",
    "Failed",
    "Finished",
    "GenerationRequest",
    "Job",
    "PromptTooLongError",
    "QueueFullError",
    "ReuseSettings",
    "Scheduler",
    "ShuttingDownError",
    "Token",
]

log = logging.getLogger("qk.scheduler")

#: Prefill chunk (positions per stage_run call) while other jobs decode. A multiple of 64 so chunk
#: boundaries sit where the chunked DeltaNet puts its own (docs/numerics.md "Chunk alignment");
#: small enough that decode steps of other slots and SSE keep-alives interleave with a long prompt.
#: With nobody decoding, a chunk is the driver's ``prefill_rows`` (the engine's piece) instead:
#: the time to first token is all that waits on it.
PREFILL_CHUNK = 512


class QueueFullError(Exception):
    """More requests wait for a slot than the queue admits."""


class ShuttingDownError(Exception):
    """The server is draining: in-flight requests finish, new ones are refused."""


class DeviceUnavailableError(Exception):
    """The model is not loaded (still loading, failed to load, or the device was lost)."""


class EmptyPromptError(ValueError):
    """A request with no prompt tokens (nothing to continue from)."""


class PromptTooLongError(ValueError):
    """The prompt does not fit a slot's context (Claude Code compacts on exactly this message)."""

    def __init__(self, n_tokens: int, maximum: int) -> None:
        super().__init__(f"prompt is too long: {n_tokens} tokens > {maximum} maximum")
        self.n_tokens = n_tokens
        self.maximum = maximum


@dataclass(frozen=True)
class GenerationRequest:
    prompt: list[int]
    #: Tokens to generate at most; None: until the slot's context is full.
    max_tokens: int | None
    params: SamplingParams = field(default_factory=SamplingParams)
    #: Ids that end generation (the model's end-of-generation set; empty for ignore_eos).
    stop_ids: frozenset[int] = frozenset()
    #: Tokens of the prompt that the next turn's prompt will start with (the rendered conversation
    #: before the new assistant cue); the state there is saved for reuse. 0: none.
    history: int = 0
    #: Whether the prompt may start from a saved state (llama.cpp's cache_prompt=false says no).
    use_cache: bool = True


@dataclass(frozen=True)
class ReuseSettings:
    """Bounds of the cross-turn reuse table: snapshot entries and the GPU bytes they may hold."""

    max_entries: int = 16
    max_bytes: int = 4 << 30


@dataclass(frozen=True)
class Token:
    id: int


@dataclass(frozen=True)
class Finished:
    #: "stop" (a stop id), "length" (max_tokens or context full), "cancelled".
    reason: str
    #: The stop id that ended generation, for "stop".
    stop_id: int | None = None


@dataclass(frozen=True)
class Failed:
    error: BaseException


Event = Token | Finished | Failed


class Job:
    """One request's life in the scheduler; its events are read on the event loop."""

    _ids = iter(range(1, 1 << 62))

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.id = next(Job._ids)
        self.request = request
        self.loop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.slot: int | None = None
        self.position = 0
        self.generated = 0
        self.pending: int | None = None
        #: A decode step of this job is in flight (handed to the driver, not yet collected).
        self.in_flight = False
        #: Prompt tokens restored from a snapshot rather than prefilled.
        self.cached = 0
        self.looked_up = False
        self.sampler = Sampler(request.params)
        self.done = False
        self._cancelled = threading.Event()
        self.submitted_at = time.monotonic()
        self.prefill_started_at: float | None = None
        self.prefill_done_at: float | None = None
        self.finished_at: float | None = None

    def cancel(self) -> None:
        """Stop generating (thread-safe, idempotent); the slot is freed before the next step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    async def next_event(self, timeout: float | None = None) -> Event | None:
        """The next event, or None when ``timeout`` seconds pass without one."""
        if timeout is None:
            return await self.queue.get()
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            return None

    def _emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:
            # The event loop is closed: nobody is left to read this job.
            pass


@dataclass
class SchedulerStats:
    """Running totals for /metrics (read without a lock: each is written by the engine thread only)."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    #: Sum over decode steps of the slots each one advanced (÷ decode_steps = mean batch).
    decode_slot_steps: int = 0
    finished: collections.Counter[str] = field(default_factory=collections.Counter)
    #: Snapshot saves or loads that failed (the request went on without reuse).
    reuse_errors: int = 0


def _topk(jobs: list[Job]) -> int:
    """The top-k one decode step of ``jobs`` asks for: the most any of their samplers needs."""
    return max(j.request.params.candidates_needed for j in jobs)


class Scheduler:
    """N slots, a FIFO of waiting jobs, one engine thread."""

    def __init__(
        self,
        load: Callable[[], Driver],
        *,
        slots: int,
        ctx: int,
        max_queue: int = 64,
        device_lost_errors: Iterable[type[BaseException]] = (),
        reuse: ReuseSettings | None = None,
    ) -> None:
        if slots < 1 or ctx < 2:
            raise ValueError("need at least one slot and a context of at least 2")
        self._load = load
        self.n_slots = slots
        self.ctx = ctx
        self.max_queue = max_queue
        self._device_lost_errors = tuple(device_lost_errors)
        self.driver: Driver | None = None
        #: "loading" → "ready"; "failed" (load raised), "device_lost", "stopped" are terminal.
        self.state = "loading"
        self.load_error: BaseException | None = None
        self.stats = SchedulerStats()
        self._reuse_settings = reuse
        #: Built once the driver is loaded (its sizes bound the table); None: reuse is off.
        self.reuse: ReuseTable | None = None
        self._invalidate = threading.Event()
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._slots: list[Job | None] = [None] * slots
        #: Decode steps handed to the driver, oldest first: (pending, jobs).
        self._lanes: collections.deque[tuple[Pending, list[Job]]] = collections.deque()
        self._draining = False
        self._thread = threading.Thread(target=self._run, name="qk-engine", daemon=True)

    # -- event-loop side ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self.state == "ready" and not self._draining

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def busy_slots(self) -> int:
        return sum(job is not None for job in self._slots)

    def slot_jobs(self) -> list[Job | None]:
        return list(self._slots)

    def check_prompt(self, n_tokens: int) -> None:
        # At least one position must remain for the reply.
        if n_tokens >= self.ctx:
            raise PromptTooLongError(n_tokens, self.ctx - 1)

    def submit(self, request: GenerationRequest) -> Job:
        """Queue a request (call on the event loop). Raises instead of queueing what cannot run."""
        if not request.prompt:
            raise EmptyPromptError("the prompt is empty")
        self.check_prompt(len(request.prompt))
        with self._cond:
            if self._draining:
                raise ShuttingDownError("the server is shutting down")
            if self.state != "ready":
                raise DeviceUnavailableError(self.unavailable_reason())
            # Jobs in the deque that a free slot is about to take are not queued behind anyone.
            free = sum(job is None for job in self._slots)
            if len(self._waiting) - free >= self.max_queue:
                raise QueueFullError(
                    f"all {self.n_slots} slots are busy and {self.max_queue} requests already wait"
                )
            job = Job(request, asyncio.get_running_loop())
            self._waiting.append(job)
            self._cond.notify()
        return job

    def wake(self) -> None:
        """Make the engine thread notice a cancellation now rather than after its next step."""
        with self._cond:
            self._cond.notify()

    def drain(self, timeout: float | None = None) -> bool:
        """Stop admitting, let admitted and queued jobs finish, stop the thread. True if it ended."""
        with self._cond:
            self._draining = True
            self._cond.notify()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def invalidate_reuse(self) -> None:
        """Void the reuse table (thread-safe): the engine thread drops every snapshot before its
        next step, so later requests prefill in full. For a restarted engine or worker."""
        self._invalidate.set()
        self.wake()

    def unavailable_reason(self) -> str:
        if self.state == "loading":
            return "the model is still loading"
        if self.state == "failed":
            return f"the model failed to load: {self.load_error}"
        if self.state == "device_lost":
            return f"the GPU device was lost: {self.load_error}"
        return "the engine has stopped"

    # -- engine thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.driver = self._load()
        except BaseException as exc:
            log.exception("loading the model failed")
            self.load_error = exc
            self.state = "failed"
            return
        # A split chain that reconnected lost every snapshot its stages held.
        self.driver.on_state_lost(self.invalidate_reuse)
        settings = self._reuse_settings
        if settings is not None and self.driver.supports_snapshots:
            info = self.driver.info()
            self.reuse = ReuseTable(
                # A split chain holds as many snapshot entries as its smallest stage offers.
                max_entries=min(
                    settings.max_entries, int(info.get("snapshot_entries", settings.max_entries))
                ),
                max_bytes=settings.max_bytes,
                state_bytes=state_bytes_from_info(info),
            )
            log.info(
                "cross-turn reuse on: %d snapshots, %.2f GiB",
                settings.max_entries,
                settings.max_bytes / 2**30,
            )
        self.state = "ready"
        log.info("engine ready: %d slots × %d context", self.n_slots, self.ctx)
        while True:
            with self._cond:
                self._admit()
                if not any(self._slots):
                    if self._draining:
                        break
                    self._cond.wait()
                    continue
            self._reap_cancelled()
            try:
                if self._invalidate.is_set():
                    self._void_reuse()
                self._turn()
            except BaseException as exc:
                # Every job must end, whatever broke.
                lost = isinstance(exc, self._device_lost_errors)
                if lost:
                    # Before the jobs hear of it, so no new request slips in after their failure.
                    self.load_error = exc
                    self.state = "device_lost"
                    log.error("GPU device lost: %s; /health now answers 503", exc)
                self._fail_everything(exc)
                if lost:
                    return
        self.state = "stopped"
        # A split driver ends its session with the chain cleanly (the workers log a close, not a
        # dead peer, and are free for the next head at once).
        try:
            self.driver.close()
        except Exception as exc:
            log.warning("closing the driver: %s", exc)

    def _admit(self) -> None:
        for slot, occupant in enumerate(self._slots):
            if occupant is not None:
                continue
            while self._waiting:
                job = self._waiting.popleft()
                if job.cancelled:
                    self._finish(job, Finished("cancelled"))
                    continue
                job.slot = slot
                self._slots[slot] = job
                params = job.request.params
                if not params.greedy:
                    log.info(
                        "job %d slot %d: temperature %g top_p %g top_k %d seed %d",
                        job.id,
                        slot,
                        params.temperature,
                        params.top_p,
                        params.top_k,
                        params.seed,
                    )
                break

    def _reap_cancelled(self) -> None:
        for job in self._slots:
            if job is not None and job.cancelled:
                self._finish(job, Finished("cancelled"))

    def _turn(self) -> None:
        driver = self.driver
        assert driver is not None
        prefilling = [j for j in self._slots if j is not None and j.pending is None]
        if prefilling:
            others_decode = any(j is not None and j.pending is not None and not j.done for j in self._slots)
            size = PREFILL_CHUNK if others_decode else max(PREFILL_CHUNK, driver.prefill_rows)
            self._prefill_chunk(driver, min(prefilling, key=lambda j: j.id), size)
        decoding = [j for j in self._slots if j is not None and j.pending is not None and not j.done]
        if driver.chains:
            self._decode_chained(driver, decoding, chain=not prefilling)
        else:
            self._decode_lanes(driver, decoding)

    def _void_reuse(self) -> None:
        self._invalidate.clear()
        if self.reuse is None or self.driver is None:
            return
        for idx in self.reuse.invalidate():
            try:
                self.driver.drop_state(idx)
            except Exception as exc:
                if isinstance(exc, self._device_lost_errors):
                    raise
                # A restarted engine no longer has it: nothing to free.
                log.debug("dropping snapshot %d: %s", idx, exc)
        log.info("reuse table voided")

    def _restore(self, driver: Driver, job: Job) -> None:
        """Start the job from the longest saved prefix of its prompt, if any."""
        job.looked_up = True
        if self.reuse is None or not job.request.use_cache:
            return
        entry = self.reuse.lookup(job.request.prompt)
        if entry is None:
            return
        try:
            driver.load_state(job.slot or 0, entry.idx)
        except Exception as exc:
            if isinstance(exc, self._device_lost_errors):
                raise
            # Never a wrong answer: the slot is reset by a prefill from position 0.
            log.warning("job %d: loading snapshot %d failed (%s); full prefill", job.id, entry.idx, exc)
            self.stats.reuse_errors += 1
            # An engine that lost one entry (restarted) lost them all: start the table afresh.
            self.reuse.invalidate()
            return
        job.position = job.cached = len(entry.tokens)

    def _snapshot_at(self, job: Job) -> int:
        if self.reuse is None:
            return 0
        return snapshot_position(job.request.history, len(job.request.prompt))

    def _save(self, driver: Driver, job: Job) -> None:
        """The slot sits at the job's snapshot position: keep its state for a later turn."""
        assert self.reuse is not None
        prefix = job.request.prompt[: job.position]
        reservation = self.reuse.reserve(prefix)
        if reservation is None:
            return
        try:
            for idx in reservation.evict:
                driver.drop_state(idx)
            driver.save_state(job.slot or 0, reservation.idx)
        except Exception as exc:
            if isinstance(exc, self._device_lost_errors):
                raise
            log.warning("job %d: saving a snapshot failed (%s); no reuse of this prefix", job.id, exc)
            self.stats.reuse_errors += 1
            self.reuse.release(reservation)
            return
        self.reuse.commit(reservation, prefix)

    def _prefill_chunk(self, driver: Driver, job: Job, size: int) -> None:
        prompt = job.request.prompt
        if job.prefill_started_at is None:
            job.prefill_started_at = time.monotonic()
        if not job.looked_up:
            self._restore(driver, job)
        end = job.position + size
        snapshot_at = self._snapshot_at(job)
        if snapshot_at > job.position:
            # Cut at the snapshot position (a multiple of 64, so the cut changes no result).
            end = min(end, snapshot_at)
        chunk = prompt[job.position : end]
        last = job.position + len(chunk) == len(prompt)
        started = time.perf_counter()
        try:
            nxt = driver.prefill(
                job.slot or 0, chunk, job.position, job.request.params.candidates_needed if last else 0
            )
        except BaseException as exc:
            if isinstance(exc, self._device_lost_errors):
                raise
            self._finish(job, Failed(exc))
            return
        self.stats.prompt_seconds += time.perf_counter() - started
        self.stats.prompt_tokens += len(chunk)
        job.position += len(chunk)
        if snapshot_at and job.position == snapshot_at:
            self._save(driver, job)
        if not last:
            return
        job.prefill_done_at = time.monotonic()
        if job.request.max_tokens is not None and job.request.max_tokens <= 0:
            self._finish(job, Finished("length"))
            return
        self._accept(job, job.sampler.pick(nxt.token, nxt.candidates))

    def _advance(self, jobs: list[Job], results: list[Next]) -> None:
        """One decode step's results: sample each job's next token (a job that ended while its
        step was in flight is skipped)."""
        self.stats.decode_steps += 1
        self.stats.decode_slot_steps += len(jobs)
        for job, nxt in zip(jobs, results, strict=True):
            if job.done:
                continue
            job.position += 1
            try:
                token = job.sampler.pick(nxt.token, nxt.candidates)
            except Exception as exc:
                self._finish(job, Failed(exc))
                continue
            self._accept(job, token)

    def _decode_lanes(self, driver: Driver, decoding: list[Job]) -> None:
        """Decode in lanes: submit one group of ready jobs per turn while fewer than the driver's
        lanes are in flight (with two lanes, half of them the first time, so two groups alternate);
        collect the oldest step when nothing could be submitted, or as soon as it is done."""
        submitted = False
        ready = [j for j in decoding if not j.in_flight]
        if ready and len(self._lanes) < driver.lanes:
            if driver.lanes > 1 and not self._lanes and len(ready) > 1:
                ready = ready[: (len(ready) + 1) // 2]
            self._submit(driver, ready)
            submitted = True
        if not self._lanes or (submitted and not self._lanes[0][0].done()):
            return
        self._collect_oldest()

    def _chainable(self, jobs: list[Job]) -> bool:
        """Whether the step after the one in flight for ``jobs`` can be submitted before its
        tokens are known: every job greedy (its next input is the step's greedy id) and sure to go
        on after that step (its limit and the context leave room for two more positions)."""
        for job in jobs:
            limit = job.request.max_tokens
            if not job.request.params.greedy or job.position + 2 >= self.ctx:
                return False
            if limit is not None and job.generated + 1 >= limit:
                return False
        return True

    def _decode_chained(self, driver: Driver, decoding: list[Job], chain: bool) -> None:
        """Decode with the next step queued behind the running one: when nothing is in flight,
        submit a step of every decoding job; while a step of exactly the decoding jobs runs and
        they are chainable, submit its successor, fed on the GPU with the running step's greedy
        ids; then collect the oldest step. The GPU never waits for the host between steps of an
        unchanged greedy batch; any change (a job joins or ends, a prefill ran) costs one step's
        overlap. A chained step of a job that ended meanwhile is skipped like a cancelled one."""
        if not self._lanes and decoding:
            self._submit(driver, decoding, chain_next=self._chainable(decoding))
        if len(self._lanes) == 1 and chain:
            pending, jobs = self._lanes[0]
            if jobs == decoding and self._chainable(jobs):
                started = time.perf_counter()
                nxt = driver.decode_chained(pending, _topk(jobs))
                self.stats.decode_seconds += time.perf_counter() - started
                self._lanes.append((nxt, jobs))
        if self._lanes:
            self._collect_oldest()

    def _submit(self, driver: Driver, jobs: list[Job], chain_next: bool = False) -> None:
        """Hand the driver a decode step of ``jobs``, fed their pending tokens."""
        started = time.perf_counter()
        pending = driver.decode_async(
            [j.slot or 0 for j in jobs], [j.pending or 0 for j in jobs], _topk(jobs), chain_next=chain_next
        )
        self.stats.decode_seconds += time.perf_counter() - started
        for job in jobs:
            job.in_flight = True
        self._lanes.append((pending, jobs))

    def _collect_oldest(self) -> None:
        """Wait for the oldest step in flight and take its tokens (a job is in flight while any
        step still queued holds it)."""
        pending, jobs = self._lanes.popleft()
        started = time.perf_counter()
        try:
            results = pending.result()
        except Exception:
            if all(job.done for job in jobs):
                # Every job of this step already ended (cancelled): its failure concerns no one.
                return
            raise
        finally:
            queued = {id(j) for _, js in self._lanes for j in js}
            for job in jobs:
                job.in_flight = id(job) in queued
            self.stats.decode_seconds += time.perf_counter() - started
        self._advance(jobs, results)

    def _accept(self, job: Job, token: int) -> None:
        """A sampled token: end the job, or emit it and keep it to feed the next step."""
        if token in job.request.stop_ids:
            self._finish(job, Finished("stop", token))
            return
        job.generated += 1
        self.stats.generated_tokens += 1
        job._emit(Token(token))
        limit = job.request.max_tokens
        # The token just emitted would sit at `position`; the slot must hold it to go on.
        if (limit is not None and job.generated >= limit) or job.position + 1 >= self.ctx:
            self._finish(job, Finished("length"))
            return
        job.pending = token

    def _finish(self, job: Job, event: Finished | Failed) -> None:
        if job.done:
            return
        job.done = True
        job.finished_at = time.monotonic()
        if job.slot is not None and self._slots[job.slot] is job:
            self._slots[job.slot] = None
        reason = event.reason if isinstance(event, Finished) else "error"
        self.stats.finished[reason] += 1
        job._emit(event)

    def _fail_everything(self, exc: BaseException) -> None:
        log.error("engine step failed: %r", exc)
        with self._cond:
            victims = [j for j in self._slots if j is not None]
            # Steps in flight belong to these jobs; their answers (or errors) are of no use now.
            self._lanes.clear()
            if isinstance(exc, self._device_lost_errors):
                victims += list(self._waiting)
                self._waiting.clear()
        for job in victims:
            self._finish(job, Failed(exc))
