"""`Registry`: the expert servers and attention replicas the control plane knows, and their liveness.

Expert servers get ids "expert-0", "expert-1", ...; attention replicas "attention-0", ... A server
re-registering with the id it had keeps it when this registry never gave that id out (the control
plane restarted and the server comes back): placements before and after the restart then name it
alike. States: serving -> draining (asked to leave) -> removed on Deregister, or back to serving
(undrain); serving/draining -> dead when no heartbeat arrived for `dead_after_s`.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc

from moemesh.contracts.info import ServerInfo
from moemesh.contracts.placement import LayerExperts
from moemesh.errors import MeshError, invalid

EXPERT_ID = re.compile(r"expert-(\d{1,9})")


@dataclass
class ExpertServerRecord:
    info: ServerInfo
    last_heartbeat: float
    stats: Any = None  # the latest moemesh.v1.ExpertStats
    held: LayerExperts = field(default_factory=dict)  # what it held when it registered
    reported_version: int = 0  # the newest placement version it had heard of when it registered
    instance: str = ""  # the process's token (heartbeats must carry it); "" = not checked


@dataclass
class AttentionRecord:
    replica_id: str
    address: str
    last_heartbeat: float
    adopted_version: int | None = None
    alive: bool = True
    instance: str = ""  # the process's token (heartbeats must carry it); "" = not checked


@dataclass
class Registry:
    clock: Callable[[], float] = time.monotonic
    experts: dict[str, ExpertServerRecord] = field(default_factory=dict)
    attention: dict[str, AttentionRecord] = field(default_factory=dict)
    _next_expert: int = 0  # ids below it may have been given out
    _given: set[str] = field(default_factory=set)  # every expert server id given out
    _attention_ids: itertools.count = field(default_factory=itertools.count)

    def register_expert(self, info: ServerInfo, held: LayerExperts | None = None, reported_version: int = 0,
                        instance: str = "") -> ServerInfo:
        """Registers `info` (its `server_id`: the id it claims, "" for none) as serving; `held` and
        `reported_version` are what a re-registering server says it holds and has heard of;
        `instance` the token its heartbeats carry."""
        if not info.address or ":" not in info.address:
            raise invalid(f"server.address must be host:port, got {info.address!r}")
        for rec in self.experts.values():  # a restarted server at the same address replaces its old record
            if rec.info.address == info.address and rec.info.state == "dead":
                del self.experts[rec.info.server_id]
                break
        server_id = self._expert_id(info.server_id)
        rec = ExpertServerRecord(dataclasses.replace(info, server_id=server_id, state="serving"), self.clock(),
                                 held=dict(held or {}), reported_version=reported_version, instance=instance)
        self.experts[server_id] = rec
        return rec.info

    def _expert_id(self, claimed: str) -> str:
        """`claimed` when it has the registry's form and was never given out here, else a fresh id."""
        m = EXPERT_ID.fullmatch(claimed)
        if m is not None and claimed not in self._given:
            self._next_expert = max(self._next_expert, int(m.group(1)) + 1)
            server_id = claimed
        else:
            while f"expert-{self._next_expert}" in self._given:
                self._next_expert += 1
            server_id = f"expert-{self._next_expert}"
            self._next_expert += 1
        self._given.add(server_id)
        return server_id

    def register_attention(self, address: str, instance: str = "") -> str:
        replica_id = f"attention-{next(self._attention_ids)}"
        self.attention[replica_id] = AttentionRecord(replica_id, address, self.clock(), instance=instance)
        return replica_id

    def heartbeat(self, id_: str, adopted_version: int | None = None, stats: Any = None, instance: str = "") -> bool:
        """False when `id_` is unknown, was declared dead, or was registered by another process
        (`instance` differs; "" on either side: not checked): the sender must register again."""
        now = self.clock()
        if id_ in self.experts:
            rec = self.experts[id_]
            if rec.info.state == "dead" or (instance and rec.instance and instance != rec.instance):
                return False
            rec.last_heartbeat = now
            rec.stats = stats if stats is not None else rec.stats
            return True
        if id_ in self.attention and self.attention[id_].alive:
            rec = self.attention[id_]
            if instance and rec.instance and instance != rec.instance:
                return False
            rec.last_heartbeat = now
            if adopted_version is not None:
                rec.adopted_version = adopted_version
            return True
        return False

    def drain(self, id_: str) -> str:
        rec = self.expert(id_)
        if rec.info.state == "serving":
            rec.info = dataclasses.replace(rec.info, state="draining")
        return rec.info.state

    def undrain(self, id_: str) -> str:
        """A draining server serves again (a serving one stays so); MeshError FAILED_PRECONDITION
        for a dead one (it must register again)."""
        rec = self.expert(id_)
        if rec.info.state == "dead":
            raise MeshError(grpc.StatusCode.FAILED_PRECONDITION, f"id: {id_!r} is dead: a dead server registers again instead")
        rec.info = dataclasses.replace(rec.info, state="serving")
        return rec.info.state

    def mark_dead(self, id_: str) -> bool:
        """Declare expert server `id_` dead now (e.g. it stopped answering); False when it already was."""
        rec = self.expert(id_)
        if rec.info.state == "dead":
            return False
        rec.info = dataclasses.replace(rec.info, state="dead")
        return True

    def deregister(self, id_: str) -> None:
        if self.experts.pop(id_, None) is None and self.attention.pop(id_, None) is None:
            raise MeshError(grpc.StatusCode.NOT_FOUND, f"id {id_!r} is not registered")

    def expert(self, id_: str) -> ExpertServerRecord:
        rec = self.experts.get(id_)
        if rec is None:
            raise MeshError(grpc.StatusCode.NOT_FOUND, f"id {id_!r} is not a registered expert server")
        return rec

    def reap(self, dead_after_s: float) -> list[str]:
        """Mark everything silent for `dead_after_s` dead; returns the expert servers newly dead."""
        now = self.clock()
        newly = []
        for rec in self.experts.values():
            if rec.info.state != "dead" and now - rec.last_heartbeat > dead_after_s:
                rec.info = dataclasses.replace(rec.info, state="dead")
                newly.append(rec.info.server_id)
        for rec in self.attention.values():
            if rec.alive and now - rec.last_heartbeat > dead_after_s:
                rec.alive = False
        return newly

    def serving(self) -> list[ServerInfo]:
        return [r.info for r in self.experts.values() if r.info.state == "serving"]

    def servers(self) -> list[ServerInfo]:
        return [r.info for r in self.experts.values()]

    def dead(self) -> list[str]:
        """Ids of the expert servers declared dead (until a new server registers from their address)."""
        return [sid for sid, r in self.experts.items() if r.info.state == "dead"]

    def live_attention(self) -> list[AttentionRecord]:
        return [r for r in self.attention.values() if r.alive]
