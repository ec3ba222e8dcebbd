"""`ReplicaSet`: the attention replicas a router spreads sequences over, least loaded first.

A replica's load = the sequences other routers placed there (its last load report minus this
router's own at report time) + this router's sequences on it now. Ties go round-robin.
Replicas whose reports fail, or that report they are draining, get no new sequences.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field

from router_svc.errors import RequestError
from router_svc.types import LoadReport

log = logging.getLogger(__name__)


@dataclass
class Replica:
    address: str
    client: object  # router_svc.attention_client.AttentionClient (or a fake in tests)
    inflight: int = 0
    others: int = 0  # sequences other routers had there at the last report
    available: bool = True
    last_report: LoadReport = field(default_factory=LoadReport)

    @property
    def load(self) -> int:
        return self.others + self.inflight

    def record(self, report: LoadReport, inflight_at_request: int) -> None:
        self.last_report = report
        self.others = max(0, report.sequences - inflight_at_request)
        self.available = report.serving


class ReplicaSet:
    def __init__(self, replicas: list[Replica]) -> None:
        if not replicas:
            raise ValueError("attention: at least one attention replica address is required")
        self.replicas = replicas
        self._turn = itertools.count()

    def pick(self, exclude: set[str] = frozenset()) -> Replica:
        """The least-loaded available replica whose address is not in `exclude`."""
        live = [r for r in self.replicas if r.available and r.address not in exclude]
        if not live:
            raise RequestError("UNAVAILABLE", "attention: no attention replica is available; retry later")
        start = next(self._turn) % len(live)
        rotated = live[start:] + live[:start]
        return min(rotated, key=lambda r: r.load)

    @contextmanager
    def track(self, replica: Replica):
        """Counts one of this router's sequences on `replica` for the body's duration."""
        replica.inflight += 1
        try:
            yield replica
        finally:
            replica.inflight -= 1

    def mark_unavailable(self, replica: Replica) -> None:
        replica.available = False

    async def refresh(self, timeout: float) -> None:
        """Asks every replica for its load at once; a replica that does not answer is unavailable."""
        await asyncio.gather(*(self._refresh_one(r, timeout) for r in self.replicas))

    async def _refresh_one(self, replica: Replica, timeout: float) -> None:
        inflight = replica.inflight
        try:
            report = await replica.client.get_load(timeout=timeout)
        except Exception as exc:  # any failure: stop sending there until it answers again
            if replica.available:
                log.warning("attention replica %s unavailable: %s", replica.address, exc)
            replica.available = False
            return
        replica.record(report, inflight)

    async def poll_forever(self, interval_s: float) -> None:
        while True:
            await self.refresh(timeout=max(interval_s, 1.0))
            await asyncio.sleep(interval_s)
