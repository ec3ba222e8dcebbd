"""`StopStringMatcher`: finds stop strings in streamed text, in time linear in the text.

Feed it text deltas; it returns the text that is safe to emit now (never any part of a stop
string) and whether a stop string matched. A tail that could still become a stop string is held
back until the next delta decides it (or `flush` releases it at the end of the stream). When
several stop strings occur, the one that completes first wins (of those completing at the same
character, the longest), so the result does not depend on how the text was cut into deltas.

It is an Aho-Corasick automaton over the stop strings, built lazily as the text walks it: a state is
the longest suffix of the text so far that is a prefix of some stop string, identified by its
length and the range of the sorted stop strings sharing that prefix (no trie is built up front, so
64 stop strings of 16,000 characters cost nothing until the text follows them). Each character
moves the state once; failure links are computed and memoized the first time they are needed.
Characters are emitted once each from a queue of pending pieces: the work per stream is linear in
its length, whatever the stop strings are.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass
from typing import Iterable

State = tuple[int, int, int]  # (depth d, lo, hi): stops[lo:hi] are those starting with the d-character prefix


@dataclass(frozen=True)
class StopMatch:
    """What `StopStringMatcher.feed` found: `text` to emit, `stopped`, and which `stop` matched."""

    text: str
    stopped: bool
    stop: str | None = None


class _Automaton:
    """Lazy Aho-Corasick over sorted, distinct stop strings (shared by nothing: one per matcher)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = sorted(set(stops))
        self.root: State = (0, 0, len(self.stops))
        self.first_chars = frozenset(s[0] for s in self.stops)
        self._goto: dict[tuple[State, str], State] = {}
        self._fail: dict[State, State] = {self.root: self.root}
        # per state: (length, index) of the longest stop string ending at it (itself or on its failure chain), or None
        self._out: dict[State, tuple[int, int] | None] = {self.root: None}

    def _child(self, state: State, c: str) -> State | None:
        """The trie edge: stops starting with the state's prefix + c, or None."""
        d, lo, hi = state
        if lo < hi and len(self.stops[lo]) == d:  # the prefix itself is a stop (it sorts first)
            lo += 1
        key = (lambda s: s[d])
        a = bisect_left(self.stops, c, lo, hi, key=key)
        if a == hi or self.stops[a][d] != c:
            return None
        return (d + 1, a, bisect_right(self.stops, c, a, hi, key=key))

    def step(self, state: State, c: str) -> State:
        """The state after `c`: the longest suffix of (state's prefix + c) that is a prefix of a stop."""
        known = self._goto.get((state, c))
        if known is not None:
            return known
        chain = []  # state's failure chain, up to the first state whose transition on c is known
        x = state
        while (x, c) not in self._goto and x != self.root:
            chain.append(x)
            x = self._fail[x]
        if (x, c) in self._goto:
            g = self._goto[(x, c)]
        else:  # x is the root
            g = self._child(self.root, c) or self.root
            self._add(g, self.root)
            self._goto[(self.root, c)] = g
        # walk back up the chain: goto(z, c) = child(z, c) if it exists, else goto(fail(z), c);
        # and fail(child(z, c)) = goto(fail(z), c), which is g at that point
        for z in reversed(chain):
            child = self._child(z, c)
            if child is not None:
                self._add(child, g)
                g = child
            self._goto[(z, c)] = g
        return g

    def _add(self, state: State, fail: State) -> None:
        if state in self._fail:
            return
        self._fail[state] = fail
        d, lo, _ = state
        self._out[state] = (d, lo) if len(self.stops[lo]) == d else self._out[fail]

    def match(self, state: State) -> tuple[int, int] | None:
        """(length, index) of the longest stop string ending here, or None."""
        return self._out[state]


class StopStringMatcher:
    """`feed(delta) -> StopMatch`; `flush() -> str`. The stop string itself is never emitted."""

    def __init__(self, stops: Iterable[str]) -> None:
        stops = tuple(stops)
        for i, s in enumerate(stops):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stops[{i}] must be a non-empty string, got {s!r}")
        self.stops = stops
        self._auto = _Automaton(stops) if stops else None
        self._state = self._auto.root if stops else None
        self._held: deque[str] = deque()  # text not emitted yet, in pieces
        self._held_len = 0
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, delta: str) -> StopMatch:
        if self._stopped:
            return StopMatch("", True)
        if self._auto is None:
            return StopMatch(delta, False)
        auto, state, root, first = self._auto, self._state, self._auto.root, self._auto.first_chars
        for i, c in enumerate(delta):
            if state == root and c not in first:
                continue
            state = auto.step(state, c)
            hit = auto.match(state)
            if hit is not None:  # the earliest-ending match: emit what precedes it, nothing after
                length, index = hit
                self._held.append(delta[: i + 1])
                self._held_len += i + 1
                self._stopped = True
                text = self._take(self._held_len - length)
                self._held.clear()
                self._held_len = 0
                return StopMatch(text, True, auto.stops[index])
        self._state = state
        self._held.append(delta)
        self._held_len += len(delta)
        return StopMatch(self._take(self._held_len - state[0]), False)  # hold back the possible start of a stop

    def _take(self, n: int) -> str:
        """Removes and returns the first n held characters."""
        parts = []
        while n > 0:
            piece = self._held.popleft()
            if len(piece) > n:
                self._held.appendleft(piece[n:])
                piece = piece[:n]
            parts.append(piece)
            n -= len(piece)
            self._held_len -= len(piece)
        return "".join(parts)

    def flush(self) -> str:
        """The held-back tail, released at the end of the stream (nothing if a stop matched)."""
        out = "" if self._stopped else "".join(self._held)
        self._held.clear()
        self._held_len = 0
        if self._auto is not None:
            self._state = self._auto.root
        return out
