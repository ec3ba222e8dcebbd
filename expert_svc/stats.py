"""`ShardStats`: tokens per (layer, expert), requests, busy time and queue depth of one server."""
from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class StatsSnapshot:
    tokens: dict[tuple[int, int], int]  # (layer, expert) -> rows computed
    requests: int
    busy_seconds: float
    window_seconds: float
    queue_depth: int


class ShardStats:
    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._tokens: Counter[tuple[int, int]] = Counter()
        self._requests = 0
        self._busy = 0.0
        self._since = clock()
        self._in_flight = 0

    def enter(self) -> None:
        with self._lock:
            self._in_flight += 1

    def leave(self) -> None:
        with self._lock:
            self._in_flight -= 1

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def record(self, layer: int, expert_ids: list[int], counts: list[int], seconds: float) -> None:
        with self._lock:
            for e, n in zip(expert_ids, counts):
                if n:
                    self._tokens[(layer, e)] += n
            self._requests += 1
            self._busy += seconds

    def snapshot(self, reset: bool = False) -> StatsSnapshot:
        with self._lock:
            now = self._clock()
            snap = StatsSnapshot(dict(self._tokens), self._requests, self._busy, now - self._since, self._in_flight)
            if reset:
                self._tokens.clear()
                self._requests = 0
                self._busy = 0.0
                self._since = now
            return snap
