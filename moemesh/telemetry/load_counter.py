"""`ExpertLoadCounter`: tokens routed to each (layer, expert), over a sliding time window.

Shape letters: L MoE layers, E logical experts.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

import torch


class ExpertLoadCounter:
    """Thread-safe per-(layer, expert) token counts: a ring of time buckets plus running totals.

    `add(layer, counts[E])` is the hot-path call: one lock, one in-place add of a CPU int64 row
    (pass counts already on the CPU, e.g. from the dispatch plan, so the call never syncs a GPU).
    `window()` sums the buckets of the last `window_s` seconds (`[L,E]`, what the placement solver
    reads); `totals()` counts since creation (what Prometheus exports as a counter).
    The window is cut into `buckets` slices, so it slides in steps of `window_s / buckets`.
    """

    def __init__(
        self,
        layers: int | Sequence[int],
        num_experts: int,
        window_s: float = 60.0,
        buckets: int = 12,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        ids = list(range(layers)) if isinstance(layers, int) else list(layers)
        if not ids or len(set(ids)) != len(ids):
            raise ValueError(f"layers must be >= 1 or a non-empty list of unique layer ids, got {layers!r}")
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 1:
            raise ValueError(f"buckets must be an int >= 1, got {buckets!r}")
        self.layer_ids: tuple[int, ...] = tuple(ids)
        self.num_experts = num_experts
        self.window_s = float(window_s)
        self._row = {layer: i for i, layer in enumerate(ids)}
        self._bucket_s = self.window_s / buckets
        self._clock = clock
        self._lock = threading.Lock()
        self._ring = torch.zeros(buckets, len(ids), num_experts, dtype=torch.int64)
        self._totals = torch.zeros(len(ids), num_experts, dtype=torch.int64)
        self._tick = self._now_tick()

    def _now_tick(self) -> int:
        return int(self._clock() // self._bucket_s)

    def _advance(self) -> int:
        """Zero the buckets that fell out of the window; return the current bucket index (lock held)."""
        tick = self._now_tick()
        n = len(self._ring)
        if tick != self._tick:
            stale = min(tick - self._tick, n)
            for k in range(1, stale + 1):
                self._ring[(self._tick + k) % n].zero_()
            self._tick = tick
        return tick % n

    def add(self, layer: int, counts: torch.Tensor) -> None:
        """Add `counts[E]` tokens (int, >= 0) to MoE layer `layer`."""
        row = self._row.get(layer)
        if row is None:
            raise ValueError(f"layer {layer!r} is not one of {self.layer_ids}")
        c = torch.as_tensor(counts).reshape(-1)
        if c.shape[0] != self.num_experts:
            raise ValueError(f"counts must have {self.num_experts} entries, got {c.shape[0]}")
        c = c.to(device="cpu", dtype=torch.int64)
        with self._lock:
            i = self._advance()
            self._ring[i, row] += c
            self._totals[row] += c

    def add_all(self, counts: torch.Tensor) -> None:
        """Add `counts[L,E]` for every layer at once (rows in `layer_ids` order)."""
        c = torch.as_tensor(counts)
        if c.shape != self._totals.shape:
            raise ValueError(f"counts must have shape {tuple(self._totals.shape)}, got {tuple(c.shape)}")
        c = c.to(device="cpu", dtype=torch.int64)
        with self._lock:
            i = self._advance()
            self._ring[i] += c
            self._totals += c

    def window(self) -> torch.Tensor:
        """Tokens per (layer, expert) over the last `window_s` seconds, `[L,E]` int64 (a copy)."""
        with self._lock:
            self._advance()
            return self._ring.sum(dim=0)

    def totals(self) -> torch.Tensor:
        """Tokens per (layer, expert) since creation, `[L,E]` int64 (a copy)."""
        with self._lock:
            return self._totals.clone()
