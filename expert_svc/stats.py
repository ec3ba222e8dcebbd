"""`ShardStats`: tokens per (layer, expert) over a sliding window, requests, busy time and queue
depth of one expert server; optionally mirrored into the server's Prometheus `ServiceMetrics`.

Over the same window it also sums the work done (`WORK`): calls, (call, expert) pairs, rows, the
seconds spent computing, the seconds with at least one call in service (from its arrival to its
answer: decoding, computing, encoding, and any wait for the server's CPU budget), the process's
CPU seconds, and of them the thread CPU seconds measured per call: inside the expert kernel
(`compute_cpu_seconds`) and in the call's handling outside it (`call_cpu_seconds`: decoding the
request, checks, encoding the answer), and the thread CPU seconds of placement changes (loading
and dropping experts: `change_cpu_seconds`, so they are not taken for the calls' cost); and it says
how many CPUs the process may use (`cpu_limit`).
The control plane calibrates its cost model from these (`control_svc/cost_model.py`)."""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from moemesh.telemetry import ExpertLoadCounter, ServiceMetrics, SlidingSums

WORK = ("requests", "expert_calls", "rows", "busy_seconds", "service_seconds", "cpu_seconds", "compute_cpu_seconds",
        "call_cpu_seconds", "change_cpu_seconds")


@dataclass(frozen=True)
class StatsSnapshot:
    tokens: dict[tuple[int, int], int]  # (layer, expert) -> rows computed over the last `window_seconds`
    requests: int  # since start or the last reset
    busy_seconds: float  # since start or the last reset
    window_seconds: float
    queue_depth: int
    work: dict[str, float]  # WORK sums over the window, and "seconds": the time they cover
    cpu_limit: float | None = None  # CPUs the process may use (None: not limited)


class ShardStats:
    def __init__(
        self,
        layers: Sequence[int],
        num_experts: int,
        window_s: float = 60.0,
        metrics: ServiceMetrics | None = None,
        clock=time.monotonic,
        cpu_limit: float | None = None,
        cpu_clock=time.process_time,
    ):
        """layers: the model's MoE layer ids; window_s: the sliding load window the control plane reads;
        cpu_limit: the CPUs this process may use (None: not limited)."""
        self.load = ExpertLoadCounter(list(layers), num_experts, window_s=window_s, clock=clock)
        self.work = SlidingSums(WORK, window_s=window_s, clock=clock)
        self.metrics = metrics
        self._clock = clock
        self._lock = threading.Lock()
        self._requests = 0
        self._busy = 0.0
        self._in_flight = 0
        self._serving_since = 0.0  # when in_flight last rose from 0
        self.cpu_limit = cpu_limit
        self._cpu_clock = cpu_clock
        self._cpu_seen = cpu_clock()  # process CPU time already added to the window
        self._last_call = -math.inf  # when the last call arrived

    def since_call(self) -> float:
        """Seconds since the last call arrived (inf before the first)."""
        return self._clock() - self._last_call

    def enter(self) -> None:
        """A call arrived (decode, compute and answer follow)."""
        with self._lock:
            self._last_call = self._clock()
            if self._in_flight == 0:
                self._serving_since = self._last_call
            self._in_flight += 1
            n = self._in_flight
        if self.metrics is not None:
            self.metrics.set_queue_depth(n)

    def leave(self, call_cpu: float = 0.0) -> None:
        """A call was answered; `call_cpu`: thread CPU seconds its handling took outside `record`'s
        (decoding the request, encoding the answer)."""
        with self._lock:
            self._in_flight -= 1
            n = self._in_flight
            served = self._clock() - self._serving_since if n == 0 else 0.0
        if served or call_cpu:
            self.work.add(service_seconds=served, call_cpu_seconds=max(0.0, call_cpu))
        if self.metrics is not None:
            self.metrics.set_queue_depth(n)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def record(self, layer: int, expert_ids: torch.Tensor, counts: torch.Tensor, seconds: float,
               count_list: list[int] | None = None, compute_cpu: float = 0.0, call_cpu: float = 0.0) -> None:
        """One computed request: counts [G] int64 rows for expert_ids [G] int64 of `layer`, `seconds` of
        compute; `count_list`: counts as a list when the caller has it (saves two tensor reductions);
        `compute_cpu`: thread CPU seconds inside the kernel; `call_cpu`: thread CPU seconds of the
        compute call outside the kernel (checks, dispatch)."""
        if expert_ids.numel():
            self.load.add_sparse(layer, expert_ids, counts)
        c = counts.tolist() if count_list is None else count_list
        self.work.add(requests=1, expert_calls=sum(1 for n in c if n > 0), rows=sum(c), busy_seconds=seconds,
                      cpu_seconds=self._cpu_since(), compute_cpu_seconds=max(0.0, compute_cpu), call_cpu_seconds=max(0.0, call_cpu))
        with self._lock:
            self._requests += 1
            self._busy += seconds
        if self.metrics is not None:
            self.metrics.add_busy(seconds)

    def changed(self, cpu_s: float) -> None:
        """A placement change (one layer's LoadExperts or DropExperts) took `cpu_s` thread CPU seconds."""
        self.work.add(change_cpu_seconds=max(0.0, cpu_s))

    def _cpu_since(self) -> float:
        """Process CPU seconds since the last call (what the window has not counted yet)."""
        now = self._cpu_clock()
        with self._lock:
            used, self._cpu_seen = now - self._cpu_seen, now
        return max(0.0, used)

    def snapshot(self, reset: bool = False) -> StatsSnapshot:
        self.work.add(cpu_seconds=self._cpu_since())
        window = self.load.window()  # [L, E]
        tokens = {
            (layer, e): int(n)
            for layer, row in zip(self.load.layer_ids, window.tolist())
            for e, n in enumerate(row)
            if n
        }
        with self._lock:
            snap = StatsSnapshot(tokens, self._requests, self._busy, self.load.window_s, self._in_flight, self.work.window(), self.cpu_limit)
            if reset:
                self._requests = 0
                self._busy = 0.0
            return snap
