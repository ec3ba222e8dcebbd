"""`Registry`: the expert servers and attention replicas the control plane knows, and their liveness.

Expert servers get ids "expert-0", "expert-1", ...; attention replicas "attention-0", ...
States: serving -> draining (asked to leave) -> removed on Deregister, or back to serving
(undrain); serving/draining -> dead when no heartbeat arrived for `dead_after_s`.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc

from moemesh.contracts.info import ServerInfo
from moemesh.errors import MeshError, invalid


@dataclass
class ExpertServerRecord:
    info: ServerInfo
    last_heartbeat: float
    stats: Any = None  # the latest moemesh.v1.ExpertStats


@dataclass
class AttentionRecord:
    replica_id: str
    address: str
    last_heartbeat: float
    adopted_version: int | None = None
    alive: bool = True


@dataclass
class Registry:
    clock: Callable[[], float] = time.monotonic
    experts: dict[str, ExpertServerRecord] = field(default_factory=dict)
    attention: dict[str, AttentionRecord] = field(default_factory=dict)
    _expert_ids: itertools.count = field(default_factory=itertools.count)
    _attention_ids: itertools.count = field(default_factory=itertools.count)

    def register_expert(self, info: ServerInfo) -> ServerInfo:
        if not info.address or ":" not in info.address:
            raise invalid(f"server.address must be host:port, got {info.address!r}")
        for rec in self.experts.values():  # a restarted server at the same address replaces its old record
            if rec.info.address == info.address and rec.info.state == "dead":
                del self.experts[rec.info.server_id]
                break
        server_id = f"expert-{next(self._expert_ids)}"
        rec = ExpertServerRecord(dataclasses.replace(info, server_id=server_id, state="serving"), self.clock())
        self.experts[server_id] = rec
        return rec.info

    def register_attention(self, address: str) -> str:
        replica_id = f"attention-{next(self._attention_ids)}"
        self.attention[replica_id] = AttentionRecord(replica_id, address, self.clock())
        return replica_id

    def heartbeat(self, id_: str, adopted_version: int | None = None, stats: Any = None) -> bool:
        """False when `id_` is unknown or was declared dead (it must register again)."""
        now = self.clock()
        if id_ in self.experts:
            rec = self.experts[id_]
            if rec.info.state == "dead":
                return False
            rec.last_heartbeat = now
            rec.stats = stats if stats is not None else rec.stats
            return True
        if id_ in self.attention and self.attention[id_].alive:
            rec = self.attention[id_]
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

    def live_attention(self) -> list[AttentionRecord]:
        return [r for r in self.attention.values() if r.alive]
