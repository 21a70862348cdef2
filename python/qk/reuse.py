"""Cross-turn state reuse on one box: the head-side table from token prefixes to engine state
snapshots (docs/architecture.md "Engine contract": ``state_save`` / ``state_load`` / ``state_drop``).

Hybrid models cannot rewind their DeltaNet state, so a later turn can only continue from a state
saved at exactly the point where its prompt diverges from nothing it has not seen. The scheduler
saves a slot's state at the last 64-aligned position at or before each prompt's history boundary
(the end of the conversation before the new assistant cue); the next turn finds the longest saved
prefix that is an exact token prefix of its prompt, loads it and prefills only the rest. Because
prefill is cut at multiples of 64 from position 0 and the engine's results do not depend on call
cuts, reuse gives the same bytes as a full prefill.

Entries are keyed by a hash of the prefix and verified against the full token list (a hash match
alone never reuses). The table is LRU, bounded by entry count (the engine's snapshot capacity) and
by bytes (what each snapshot holds on the GPU). ``invalidate()`` voids everything: a restarted
engine or worker no longer holds the states the indices name.

Example::

    table = ReuseTable(max_entries=16, max_bytes=4 << 30, state_bytes=lambda n: 1024 * n)
    hit = table.lookup(prompt)            # None, or the longest cached prefix
    plan = table.reserve(prompt[:1024])    # index to state_save into, and indices to state_drop
"""

from __future__ import annotations

import collections
import hashlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ALIGN",
    "Entry",
    "ReuseStats",
    "ReuseTable",
    "Reservation",
    "normalise_billing_header",
    "snapshot_position",
    "state_bytes_from_info",
]

#: Snapshot positions are multiples of the DeltaNet chunk, where prefill cuts cannot change results.
ALIGN = 64


def snapshot_position(history_len: int, prompt_len: int) -> int:
    """Where to save a prompt's state: the last multiple of ``ALIGN`` at or before the history
    boundary, and strictly before the prompt's end (the last prompt position must be run to give
    the first reply token). 0 means no snapshot."""
    limit = min(history_len, prompt_len - 1)
    return max(0, limit) // ALIGN * ALIGN


def state_bytes_from_info(info: Mapping[str, Any]) -> Callable[[int], int]:
    """Bytes a snapshot at position ``n`` holds, from ``engine.info()["memory"]``: every DeltaNet
    layer's conv and S (fixed), plus the attention KV rows up to ``n`` (a share of the per-slot KV,
    which is sized for ``ctx`` positions)."""
    memory = info.get("memory") or {}
    fixed = int(memory.get("deltanet_per_slot", 0))
    kv = int(memory.get("kv_per_slot", 0))
    ctx = max(1, int(info.get("ctx", 1)))

    def state_bytes(n: int) -> int:
        return fixed + -(-kv * n // ctx)

    return state_bytes


def _key(tokens: Sequence[int]) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(b"".join(int(t).to_bytes(4, "little") for t in tokens))
    return digest.digest()


@dataclass(frozen=True)
class Entry:
    """One saved state: the engine's snapshot index, the exact prefix it holds, its size."""

    idx: int
    tokens: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Reservation:
    """Save the slot's state into ``idx`` after dropping ``evict`` from the engine."""

    idx: int
    evict: list[int]


@dataclass
class ReuseStats:
    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    saved: int = 0
    evicted: int = 0
    invalidations: int = 0


class ReuseTable:
    """Token prefix → snapshot entry, LRU within ``max_entries`` and ``max_bytes``. Used from the
    engine thread only (no lock); the /metrics reader sees plain integers."""

    def __init__(self, *, max_entries: int, max_bytes: int, state_bytes: Callable[[int], int]) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("the reuse table needs room for at least one entry")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.state_bytes = state_bytes
        self.stats = ReuseStats()
        self._entries: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()
        #: Prefix lengths present, so a lookup hashes only lengths that can match.
        self._lengths: collections.Counter[int] = collections.Counter()
        self._bytes = 0
        # Indices stay below max_entries: a split's workers hold only that many snapshot entries
        # (qkp op 3 refuses others). Reusing one is safe because every save overwrites its entry on
        # every stage before the table commits it, and only committed entries are ever loaded.
        self._free = list(range(max_entries))

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def lookup(self, prompt: Sequence[int]) -> Entry | None:
        """The longest entry whose tokens are an exact prefix of ``prompt`` and shorter than it
        (at least one position must remain to run). Counts a hit or a miss."""
        for n in sorted(self._lengths, reverse=True):
            if n >= len(prompt):
                continue
            key = _key(prompt[:n])
            entry = self._entries.get(key)
            if entry is not None and list(entry.tokens) == list(prompt[:n]):
                self._entries.move_to_end(key)
                self.stats.hits += 1
                self.stats.reused_tokens += n
                return entry
        self.stats.misses += 1
        return None

    def contains(self, prefix: Sequence[int]) -> bool:
        entry = self._entries.get(_key(prefix))
        return entry is not None and list(entry.tokens) == list(prefix)

    def reserve(self, prefix: Sequence[int]) -> Reservation | None:
        """Make room for a snapshot of ``prefix``: None when it is already cached (it is marked
        recently used) or could never fit the byte budget. Otherwise the caller drops the evicted
        indices from the engine, saves into ``idx`` and calls ``commit``."""
        key = _key(prefix)
        existing = self._entries.get(key)
        if existing is not None and list(existing.tokens) == list(prefix):
            self._entries.move_to_end(key)
            return None
        nbytes = self.state_bytes(len(prefix))
        if nbytes > self.max_bytes:
            return None
        evict: list[int] = []
        if existing is not None:
            # A hash collision with a different prefix: the newer one takes the key.
            evict.append(self._remove(key).idx)
        while self._entries and (
            len(self._entries) + 1 > self.max_entries or self._bytes + nbytes > self.max_bytes
        ):
            oldest = next(iter(self._entries))
            evict.append(self._remove(oldest).idx)
            self.stats.evicted += 1
        self._free.extend(evict)
        self._free.sort()
        return Reservation(self._free.pop(0), evict)

    def release(self, reservation: Reservation) -> None:
        """The save into ``reservation.idx`` failed: the index is free again (the evicted entries
        stay evicted; the caller has dropped them)."""
        if reservation.idx not in self._free:
            self._free.append(reservation.idx)
            self._free.sort()

    def commit(self, reservation: Reservation, prefix: Sequence[int]) -> None:
        """Record that ``reservation.idx`` now holds the state after ``prefix``."""
        entry = Entry(reservation.idx, tuple(int(t) for t in prefix), self.state_bytes(len(prefix)))
        self._entries[_key(prefix)] = entry
        self._lengths[len(prefix)] += 1
        self._bytes += entry.nbytes
        self.stats.saved += 1

    def invalidate(self) -> list[int]:
        """Forget every entry (the engine that held them restarted); returns their indices so a
        still-live engine can drop them."""
        indices = [e.idx for e in self._entries.values()]
        self._free = list(range(self.max_entries))
        self._entries.clear()
        self._lengths.clear()
        self._bytes = 0
        self.stats.invalidations += 1
        return indices

    def _remove(self, key: bytes) -> Entry:
        entry = self._entries.pop(key)
        self._lengths[len(entry.tokens)] -= 1
        if not self._lengths[len(entry.tokens)]:
            del self._lengths[len(entry.tokens)]
        self._bytes -= entry.nbytes
        return entry


_BILLING_STAMP = re.compile(r"(x-anthropic-billing-header:[^\n]*?\bcch=)[0-9A-Za-z]+;")


def normalise_billing_header(text: str) -> str:
    """Claude Code stamps its system prompt's ``x-anthropic-billing-header`` line with a ``cch=``
    value that changes on every request; fixing it to ``fffff`` (as llama.cpp does) keeps the rest
    of the conversation a reusable prefix. Other text is untouched."""
    if "x-anthropic-billing-header:" not in text:
        return text
    return _BILLING_STAMP.sub(r"\g<1>fffff;", text)
