"""`SlidingSums`: named sums over a sliding time window (a ring of time buckets, as
`ExpertLoadCounter` keeps per-expert token counts)."""
from __future__ import annotations

import threading
import time
from typing import Callable, Sequence


class SlidingSums:
    """Thread-safe sums of a few named quantities over the last `window_s` seconds, sliding in
    steps of `window_s / buckets`. `window()` also says how many seconds the sums cover (less than
    `window_s` while the counter is younger than its window)."""

    def __init__(self, names: Sequence[str], window_s: float = 60.0, buckets: int = 12, clock: Callable[[], float] = time.monotonic) -> None:
        if not names or len(set(names)) != len(names) or "seconds" in names:
            raise ValueError(f"names must be unique, non-empty and not 'seconds', got {list(names)!r}")
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 1:
            raise ValueError(f"buckets must be an int >= 1, got {buckets!r}")
        self.names = tuple(names)
        self.window_s = float(window_s)
        self._bucket_s = self.window_s / buckets
        self._clock = clock
        self._lock = threading.Lock()
        self._ring = [[0.0] * len(self.names) for _ in range(buckets)]
        self._index = {n: i for i, n in enumerate(self.names)}
        self._created = clock()
        self._tick = int(self._created // self._bucket_s)

    def _advance(self) -> int:
        """Zero the buckets that fell out of the window; return the current bucket (lock held)."""
        tick = int(self._clock() // self._bucket_s)
        n = len(self._ring)
        for k in range(1, min(tick - self._tick, n) + 1):
            self._ring[(self._tick + k) % n] = [0.0] * len(self.names)
        self._tick = max(self._tick, tick)
        return self._tick % n

    def add(self, **values: float) -> None:
        """Add to the named sums (unknown names are a ValueError)."""
        if not self._index.keys() >= values.keys():
            raise ValueError(f"unknown sums {sorted(set(values) - set(self._index))}; these are {list(self.names)}")
        with self._lock:
            bucket = self._ring[self._advance()]
            for name, v in values.items():
                bucket[self._index[name]] += v

    def window(self) -> dict[str, float]:
        """Each sum over the window, and "seconds": the time it covers."""
        with self._lock:
            self._advance()
            sums = [sum(b[i] for b in self._ring) for i in range(len(self.names))]
            start = max(self._created, (self._tick - len(self._ring) + 1) * self._bucket_s)
            return {**dict(zip(self.names, sums)), "seconds": max(0.0, self._clock() - start)}
