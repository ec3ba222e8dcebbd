"""`ShardStats`: tokens per (layer, expert) over a sliding window, requests, busy time and queue
depth of one expert server; optionally mirrored into the server's Prometheus `ServiceMetrics`."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from moemesh.telemetry import ExpertLoadCounter, ServiceMetrics


@dataclass(frozen=True)
class StatsSnapshot:
    tokens: dict[tuple[int, int], int]  # (layer, expert) -> rows computed over the last `window_seconds`
    requests: int  # since start or the last reset
    busy_seconds: float  # since start or the last reset
    window_seconds: float
    queue_depth: int


class ShardStats:
    def __init__(
        self,
        layers: Sequence[int],
        num_experts: int,
        window_s: float = 60.0,
        metrics: ServiceMetrics | None = None,
        clock=time.monotonic,
    ):
        """layers: the model's MoE layer ids; window_s: the sliding load window the control plane reads."""
        self.load = ExpertLoadCounter(list(layers), num_experts, window_s=window_s, clock=clock)
        self.metrics = metrics
        self._lock = threading.Lock()
        self._requests = 0
        self._busy = 0.0
        self._in_flight = 0

    def enter(self) -> None:
        with self._lock:
            self._in_flight += 1
            n = self._in_flight
        if self.metrics is not None:
            self.metrics.set_queue_depth(n)

    def leave(self) -> None:
        with self._lock:
            self._in_flight -= 1
            n = self._in_flight
        if self.metrics is not None:
            self.metrics.set_queue_depth(n)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def record(self, layer: int, expert_ids: torch.Tensor, counts: torch.Tensor, seconds: float) -> None:
        """One computed request: counts [G] int64 rows for expert_ids [G] int64 of `layer`, `seconds` of compute."""
        if expert_ids.numel():
            self.load.add_sparse(layer, expert_ids, counts)
        with self._lock:
            self._requests += 1
            self._busy += seconds
        if self.metrics is not None:
            self.metrics.add_busy(seconds)

    def snapshot(self, reset: bool = False) -> StatsSnapshot:
        window = self.load.window()  # [L, E]
        tokens = {
            (layer, e): int(n)
            for layer, row in zip(self.load.layer_ids, window.tolist())
            for e, n in enumerate(row)
            if n
        }
        with self._lock:
            snap = StatsSnapshot(tokens, self._requests, self._busy, self.load.window_s, self._in_flight)
            if reset:
                self._requests = 0
                self._busy = 0.0
            return snap
