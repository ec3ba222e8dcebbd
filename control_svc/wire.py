"""`Placement` and expert-server records <-> their moemesh.v1 control messages."""
from __future__ import annotations

from dataclasses import dataclass

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
