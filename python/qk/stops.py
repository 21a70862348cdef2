"""Stop strings over streamed text: a match can straddle token (and piece) boundaries.

``StopMatcher`` holds back the longest tail that could still grow into a stop string, releases
text as soon as it cannot, and reports the stop string that matched; the stop string itself and
everything after it are never released.

Example::

    matcher = StopMatcher(["\\nUser:", "###"])
    for piece in pieces:
        out = matcher.push(piece)
        send(out.text)
        if out.stop is not None:
            break            # stop_reason = "stop_sequence", stop_sequence = out.stop
    else:
        send(matcher.flush())
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["StopMatch", "StopMatcher"]


@dataclass(frozen=True)
class StopMatch:
    #: Text that is final and may be shown.
    text: str
    #: The stop string that ended the output, or None while none has.
    stop: str | None = None


class StopMatcher:
    def __init__(self, stops: Iterable[str]) -> None:
        # Empty strings would match everywhere; duplicates change nothing.
        self.stops: tuple[str, ...] = tuple(sorted({s for s in stops if s}))
        self._held = ""
        self.stopped: str | None = None

    def push(self, text: str) -> StopMatch:
        if self.stopped is not None:
            return StopMatch("", self.stopped)
        if not self.stops:
            return StopMatch(text)
        buffer = self._held + text
        match = self._earliest_match(buffer)
        if match is not None:
            at, stop = match
            self._held = ""
            self.stopped = stop
            return StopMatch(buffer[:at], stop)
        keep = self._partial_length(buffer)
        self._held = buffer[len(buffer) - keep :]
        return StopMatch(buffer[: len(buffer) - keep])

    def flush(self) -> str:
        """The held-back tail, once generation ended without reaching a stop string."""
        if self.stopped is not None:
            return ""
        held, self._held = self._held, ""
        return held

    @property
    def held(self) -> str:
        return self._held

    def _earliest_match(self, buffer: str) -> tuple[int, str] | None:
        # The stop that completes first wins, as it would have had the text come one character at
        # a time (so the answer does not depend on how the text was split); of stops completing at
        # the same character, the one that started earlier (the longer) wins.
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            at = buffer.find(stop)
            if at >= 0:
                candidate = (at + len(stop), at, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        return None if best is None else (best[1], best[2])

    def _partial_length(self, buffer: str) -> int:
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest
