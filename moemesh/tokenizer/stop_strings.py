"""`StopStringMatcher`: finds stop strings in streamed text.

Feed it text deltas; it returns the text that is safe to emit now (never any part of a stop
string) and whether a stop string matched. A tail that could still become a stop string is held
back until the next delta decides it (or `flush` releases it at the end of the stream). When
several stop strings occur, the one that completes first wins, so the result does not depend on
how the text was cut into deltas.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class StopMatch:
    """What `StopStringMatcher.feed` found: `text` to emit, `stopped`, and which `stop` matched."""

    text: str
    stopped: bool
    stop: str | None = None


class StopStringMatcher:
    """`feed(delta) -> StopMatch`; `flush() -> str`. The stop string itself is never emitted."""

    def __init__(self, stops: Iterable[str]) -> None:
        stops = tuple(stops)
        for i, s in enumerate(stops):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stops[{i}] must be a non-empty string, got {s!r}")
        self.stops = stops
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def _partial_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def feed(self, delta: str) -> StopMatch:
        if self._stopped:
            return StopMatch("", True)
        text = self._held + delta
        # The stop that completes first wins (as it would when streaming one character at a time).
        first: tuple[int, int, str] | None = None
        for s in self.stops:
            idx = text.find(s)
            if idx >= 0 and (first is None or (idx + len(s), idx) < first[:2]):
                first = (idx + len(s), idx, s)
        if first is not None:
            self._held = ""
            self._stopped = True
            return StopMatch(text[: first[1]], True, first[2])
        keep = self._partial_len(text)
        self._held = text[len(text) - keep:] if keep else ""
        return StopMatch(text[: len(text) - keep], False)

    def flush(self) -> str:
        """The held-back tail, released at the end of the stream (nothing if a stop matched)."""
        out, self._held = ("" if self._stopped else self._held), ""
        return out
