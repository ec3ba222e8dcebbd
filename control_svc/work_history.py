"""Each expert server's earlier load windows, for the fits that need the work to vary over time.

A server's window (ExpertStats.window_work) slides: successive heartbeats report windows that
mostly overlap. `WorkHistory` keeps one of them every half window (the latest `keep`), so that
windows at another top-k or under another placement stay beside the current one: the cost model
fits a call's CPU per row from how it changed with the rows per call (`cost_model.call_row_cpu`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from control_svc.cost_model import WorkSample


@dataclass
class WorkHistory:
    """`record(server, sample, now)` on each report; `windows()`: each server's kept samples, oldest first."""

    keep: int = 8  # windows kept per server
    spacing: float = 0.5  # of a window's length between kept windows
    _kept: dict[str, deque[tuple[float, WorkSample]]] = field(default_factory=dict)

    def record(self, server_id: str, sample: WorkSample, now: float) -> None:
        if self.keep < 1 or sample.seconds <= 0 or sample.requests <= 0:
            return
        kept = self._kept.setdefault(server_id, deque(maxlen=self.keep))
        if kept and now - kept[-1][0] < self.spacing * sample.seconds:
            return
        kept.append((now, sample))

    def forget(self, server_id: str) -> None:
        """A server that left or restarted: its earlier windows describe another process."""
        self._kept.pop(server_id, None)

    def windows(self) -> dict[str, list[WorkSample]]:
        return {sid: [s for _, s in kept] for sid, kept in self._kept.items()}

    def earlier(self, current: dict[str, WorkSample]) -> dict[str, list[WorkSample]]:
        """windows() without each server's `current` window (the last kept may be it)."""
        return {sid: [s for s in kept if s != current.get(sid)] for sid, kept in self.windows().items()}
