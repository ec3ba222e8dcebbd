"""`ReplicaSet`: the attention replicas a router spreads sequences over: prefix-aware, else least loaded.

A replica's load = the sequences other routers placed there (its last load report minus this
router's own at report time) + this router's sequences on it now. Ties go round-robin.
Prefix-aware routing (`prefix_imbalance` set): a request goes to the replica whose `PrefixIndex`
matches most leading blocks of its prompt (it most likely holds them in its prefix cache), unless
that replica's load exceeds the least loaded one's by more than `prefix_imbalance` sequences; with
no match anywhere, to the least loaded. Either way the chosen replica's index records the prompt.
Replicas whose reports fail, or that report they are draining, get no new sequences.
`reconcile` follows discovery: new addresses join (available once their first load report arrives),
vanished ones retire: no new sequences, their in-flight ones finish, and `sweep` closes the client
once none is left.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

from moemesh.block_hash import BlockHash
from moemesh.contracts.info import LoadReport
from moemesh.errors import MeshError
from router_svc.prefix_index import DEFAULT_CAPACITY, PrefixIndex

log = logging.getLogger(__name__)


@dataclass
class Replica:
    address: str
    client: object  # router_svc.attention_client.AttentionClient (or a fake in tests)
    inflight: int = 0
    others: int = 0  # sequences other routers had there at the last report
    available: bool = True
    retired: bool = False  # gone from discovery: drains, then its client is closed
    last_report: LoadReport = field(default_factory=LoadReport)
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)  # prompts recently sent here

    @property
    def load(self) -> int:
        return self.others + self.inflight

    def record(self, report: LoadReport, inflight_at_request: int) -> None:
        self.last_report = report
        self.others = max(0, report.sequences - inflight_at_request)
        self.available = report.serving
        self.prefixes.capacity = report.total_blocks or DEFAULT_CAPACITY


class ReplicaSet:
    def __init__(self, replicas: list[Replica], prefix_imbalance: int | None = None) -> None:
        if not replicas:
            raise ValueError("attention: at least one attention replica address is required")
        if prefix_imbalance is not None and prefix_imbalance < 0:
            raise ValueError(f"prefix_imbalance must be >= 0 (or None: prefix-aware routing off), got {prefix_imbalance}")
        self.prefix_imbalance = prefix_imbalance
        self.replicas = replicas  # the active ones, which get new sequences
        self.retiring: list[Replica] = []  # retired, with sequences still in flight
        self._turn = itertools.count()

    def pick(self, exclude: set[str] = frozenset(), prefix: list[BlockHash] | tuple[BlockHash, ...] = ()) -> Replica:
        """The available replica (address not in `exclude`) for a prompt whose full blocks have the keys
        `prefix`: the one holding the longest prefix of it unless too loaded (see the module), else the
        least loaded."""
        live = [r for r in self.replicas if r.available and r.address not in exclude]
        if not live:
            raise MeshError(grpc.StatusCode.UNAVAILABLE, "attention: no attention replica is available; retry later")
        start = next(self._turn) % len(live)
        rotated = live[start:] + live[:start]
        least = min(rotated, key=lambda r: r.load)
        if self.prefix_imbalance is None or not prefix:
            return least
        matched = {id(r): r.prefixes.match(prefix) for r in rotated}
        holder = max(rotated, key=lambda r: (matched[id(r)], -r.load))
        chosen = holder if matched[id(holder)] and holder.load - least.load <= self.prefix_imbalance else least
        chosen.prefixes.insert(prefix)
        return chosen

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

    def reconcile(self, addresses: list[str], make_client) -> tuple[list[Replica], list[Replica]]:
        """Makes the active replicas those at `addresses` -> (added, retired). An empty list changes
        nothing (discovery found nothing: keep serving with what is known). A retiring replica whose
        address comes back is active again."""
        if not addresses:
            return [], []
        wanted = set(addresses)
        active = {r.address for r in self.replicas}
        retired = [r for r in self.replicas if r.address not in wanted]
        for r in retired:
            r.retired, r.available = True, False
        self.replicas = [r for r in self.replicas if r.address in wanted]
        self.retiring += retired
        added: list[Replica] = []
        for address in addresses:
            if address in active:
                continue
            back = next((r for r in self.retiring if r.address == address), None)
            if back is not None:
                self.retiring.remove(back)
                back.retired = False
                replica = back
            else:
                replica = Replica(address, make_client(address), available=False)
            self.replicas.append(replica)
            active.add(address)
            added.append(replica)
        return added, retired

    async def sweep(self) -> list[Replica]:
        """Closes the clients of retired replicas with nothing left in flight -> those replicas."""
        done = [r for r in self.retiring if r.inflight == 0]
        self.retiring = [r for r in self.retiring if r.inflight > 0]
        for r in done:
            await _close(r)
        return done

    async def close(self) -> None:
        """Closes every client, active and retiring."""
        for r in [*self.replicas, *self.retiring]:
            await _close(r)

    async def refresh(self, timeout: float, replicas: list[Replica] | None = None) -> None:
        """Asks every active replica (or those given) for its load at once; one that does not answer
        is unavailable."""
        targets = self.replicas if replicas is None else replicas
        await asyncio.gather(*(self._refresh_one(r, timeout) for r in targets))

    async def _refresh_one(self, replica: Replica, timeout: float) -> None:
        inflight = replica.inflight
        try:
            report = await replica.client.get_load(timeout=timeout)
        except Exception as exc:  # any failure: stop sending there until it answers again
            if replica.available:
                log.warning("attention replica %s unavailable: %s", replica.address, exc)
            replica.available = False
            return
        if not replica.retired:
            replica.record(report, inflight)

    async def poll_forever(self, interval_s: float) -> None:
        while True:
            await self.refresh(timeout=max(interval_s, 1.0))
            await self.sweep()
            await asyncio.sleep(interval_s)


async def _close(replica: Replica) -> None:
    try:
        await replica.client.close()
    except Exception as exc:  # closing a channel must not stop the others from closing
        log.warning("closing attention replica %s: %s", replica.address, exc)
