"""`Placement` and expert-server records <-> their moemesh.v1 control messages."""
from __future__ import annotations

from dataclasses import dataclass

from control_svc.knobs import LayerKnobSetting, RoutingKnobs
from control_svc.placement.types import Placement
from moemesh.rpc.protos import load

control_pb2, control_grpc = load("control")

STATES = {
    "serving": control_pb2.SERVER_STATE_SERVING,
    "draining": control_pb2.SERVER_STATE_DRAINING,
    "dead": control_pb2.SERVER_STATE_DEAD,
}
STATE_NAMES = {v: k for k, v in STATES.items()}


@dataclass(frozen=True)
class ServerInfo:
    """An expert server as the control plane and attention replicas know it."""

    server_id: str
    address: str
    device: str = "cpu"
    memory_bytes: int = 0
    slot_budget: int = 0  # 0 = no limit
    host_id: str = ""
    dist_addr: str = ""  # empty: no torch.distributed transport offered
    state: str = "serving"


def placement_to_proto(p: Placement):
    return control_pb2.Placement(
        version=p.version,
        layers=[
            control_pb2.LayerPlacement(layer=layer, experts=[control_pb2.ExpertReplicas(server_ids=list(c)) for c in p.replicas[layer]])
            for layer in p.layers
        ],
    )


def placement_from_proto(msg) -> Placement:
    return Placement(
        version=msg.version,
        replicas={lp.layer: tuple(tuple(er.server_ids) for er in lp.experts) for lp in msg.layers},
    )


def server_to_proto(s: ServerInfo):
    return control_pb2.ExpertServerInfo(
        server_id=s.server_id,
        address=s.address,
        device=s.device,
        memory_bytes=s.memory_bytes,
        slot_budget=s.slot_budget,
        host_id=s.host_id,
        dist_addr=s.dist_addr,
        state=STATES[s.state],
    )


def server_from_proto(msg) -> ServerInfo:
    return ServerInfo(
        server_id=msg.server_id,
        address=msg.address,
        device=msg.device or "cpu",
        memory_bytes=msg.memory_bytes,
        slot_budget=msg.slot_budget,
        host_id=msg.host_id,
        dist_addr=msg.dist_addr,
        state=STATE_NAMES.get(msg.state, "serving"),
    )


def knobs_to_proto(k: RoutingKnobs):
    msg = control_pb2.MoeKnobs(
        layers=[control_pb2.LayerKnobs(layer=s.layer, top_k=s.top_k, capacity_factor=s.capacity_factor) for s in k.layers]
    )
    if k.top_k is not None:
        msg.top_k = k.top_k
    if k.capacity_factor is not None:
        msg.capacity_factor = k.capacity_factor
    return msg


def knobs_from_proto(msg) -> RoutingKnobs:
    def opt(m, name):
        return getattr(m, name) if m.HasField(name) else None

    return RoutingKnobs(
        opt(msg, "top_k"),
        opt(msg, "capacity_factor"),
        tuple(LayerKnobSetting(l.layer, opt(l, "top_k"), opt(l, "capacity_factor")) for l in msg.layers),
    )
