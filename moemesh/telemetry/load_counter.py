"""`ExpertLoadCounter`: tokens routed to each (layer, expert), over a sliding time window.

Shape letters: L MoE layers, E logical experts.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

import torch


def _cpu_int64(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor) and x.dtype is torch.int64 and x.device.type == "cpu":
        return x
    return torch.as_tensor(x).to(device="cpu", dtype=torch.int64)


class ExpertLoadCounter:
    """Thread-safe per-(layer, expert) token counts: a ring of time buckets plus running totals.

    `add(layer, counts[E])` (or `add_sparse(layer, expert_ids[G], counts[G])`) is the hot-path call: one lock, one in-place add of a CPU int64 row
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
        self._rows = [list(bucket.unbind(0)) for bucket in self._ring]  # [bucket][row] views, no indexing on add
        self._retired = torch.zeros(len(ids), num_experts, dtype=torch.int64)  # counts of buckets already recycled
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
                bucket = self._ring[(self._tick + k) % n]
                self._retired += bucket
                bucket.zero_()
            self._tick = tick
        return tick % n

    def add(self, layer: int, counts: torch.Tensor) -> None:
        """Add `counts[E]` tokens (int, >= 0) to MoE layer `layer`."""
        row = self._row.get(layer)
        if row is None:
            raise ValueError(f"layer {layer!r} is not one of {self.layer_ids}")
        c = _cpu_int64(counts)
        if c.shape != (self.num_experts,):
            raise ValueError(f"counts must have {self.num_experts} entries, got shape {tuple(c.shape)}")
        with self._lock:
            self._rows[self._advance()][row].add_(c)

    def add_sparse(self, layer: int, expert_ids: torch.Tensor, counts: torch.Tensor) -> None:
        """Add `counts[G]` tokens to experts `expert_ids[G]` of `layer` (the dispatch plan's groups,
        as `ExpertCompute.submit` receives them; an expert may appear more than once)."""
        row = self._row.get(layer)
        if row is None:
            raise ValueError(f"layer {layer!r} is not one of {self.layer_ids}")
        ids, c = _cpu_int64(expert_ids).reshape(-1), _cpu_int64(counts).reshape(-1)
        if ids.shape != c.shape:
            raise ValueError(f"expert_ids and counts must have the same length, got {ids.shape[0]} and {c.shape[0]}")
        with self._lock:
            try:  # index_add_ checks the range itself: no extra pass over the ids
                self._rows[self._advance()][row].index_add_(0, ids, c)
            except (IndexError, RuntimeError) as e:
                raise ValueError(f"expert_ids must be in [0, {self.num_experts}), got {ids.tolist()}") from e

    def add_all(self, counts: torch.Tensor) -> None:
        """Add `counts[L,E]` for every layer at once (rows in `layer_ids` order)."""
        c = _cpu_int64(counts)
        if c.shape != self._retired.shape:
            raise ValueError(f"counts must have shape {tuple(self._retired.shape)}, got {tuple(c.shape)}")
        with self._lock:
            self._ring[self._advance()].add_(c)

    def window(self) -> torch.Tensor:
        """Tokens per (layer, expert) over the last `window_s` seconds, `[L,E]` int64 (a copy)."""
        with self._lock:
            self._advance()
            return self._ring.sum(dim=0)

    def totals(self) -> torch.Tensor:
        """Tokens per (layer, expert) since creation, `[L,E]` int64 (a copy)."""
        with self._lock:
            return self._retired + self._ring.sum(dim=0)
