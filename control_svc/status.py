"""`ControlStatus`: what `moemesh ctl status` shows, gathered from the plane (no gRPC here)."""
from __future__ import annotations

from dataclasses import dataclass

from moemesh.contracts.info import ServerInfo
from moemesh.contracts.knobs import MoeKnobs
from moemesh.contracts.placement import Placement


@dataclass(frozen=True)
class ExpertServerStatus:
    info: ServerInfo
    seconds_since_heartbeat: float
    experts_held: int  # (layer, expert) copies the committed placement gives it
    window_tokens: int
    stats: object  # the latest moemesh.v1.ExpertStats, or None before the first heartbeat


@dataclass(frozen=True)
class ReplicaStatus:
    replica_id: str
    address: str
    adopted_version: int
    alive: bool
    seconds_since_heartbeat: float


@dataclass(frozen=True)
class ControlStatus:
    placement: Placement
    knobs: MoeKnobs
    balancedness: float
    window_tokens: int
    servers: tuple[ExpertServerStatus, ...]
    replicas: tuple[ReplicaStatus, ...]
    switching: bool
    expert_loads: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (MoE layer, window tokens per logical expert)


def gather_status(plane) -> ControlStatus:
    """plane: a `control_svc.plane.ControlPlane`."""
    now = plane.registry.clock()
    view = plane.board.current
    servers = []
    for rec in plane.registry.experts.values():
        held = sum(len(es) for es in view.placement.experts_on(rec.info.server_id).values())
        tokens = sum(l.tokens for l in rec.stats.loads) if rec.stats is not None else 0
        servers.append(ExpertServerStatus(rec.info, now - rec.last_heartbeat, held, tokens, rec.stats))
    replicas = tuple(
        ReplicaStatus(r.replica_id, r.address, r.adopted_version or 0, r.alive, now - r.last_heartbeat)
        for r in plane.registry.attention.values()
    )
    load = plane.load()  # [L, E]
    loads = tuple((layer, tuple(int(n) for n in row)) for layer, row in zip(plane.moe_layers, load.tolist()))
    return ControlStatus(
        view.placement, view.knobs, plane.balancedness(), int(load.sum()), tuple(servers), replicas, bool(plane.switch.running),
        loads,
    )
