"""`MeshView`: the control plane's status as the chat page's JSON (`GET /api/mesh`).

    {"available": true, "placement_version": 3, "balancedness": 0.93, "window_tokens": 1200,
     "switching": false, "knobs": {"top_k": null, "capacity_factor": null},
     "servers": [{"id", "address", "state", "device", "experts_held", "window_tokens", "queue_depth",
                  "busy_seconds", "heartbeat_age_s", "gpu": {...} | null}],
     "replicas": [{"id", "address", "adopted_version", "alive"}],
     "layers": [0, 1, ...], "num_experts": 8,
     "load": [[tokens per expert] per layer],        # the heat map
     "placement": [[[server ids] per expert] per layer]}

Without a control plane address, or when it does not answer, `{"available": false, "error": ...}`.
"""
from __future__ import annotations

import grpc

from moemesh.rpc.config import RpcConfig
from moemesh.rpc.protos import load
from moemesh.rpc.server import make_channel

control_pb2, control_grpc = load("control")
STATE_NAMES = {
    control_pb2.SERVER_STATE_SERVING: "serving",
    control_pb2.SERVER_STATE_DRAINING: "draining",
    control_pb2.SERVER_STATE_DEAD: "dead",
}


def status_json(st) -> dict:
    """A ControlService StatusResponse -> the page's JSON."""
    layers = [lp.layer for lp in st.placement.layers]
    num_experts = max((len(lp.experts) for lp in st.placement.layers), default=0)
    row = {layer: i for i, layer in enumerate(layers)}
    heat = [[0] * num_experts for _ in layers]
    for el in st.expert_loads:
        if el.layer in row and 0 <= el.expert_id < num_experts:
            heat[row[el.layer]][el.expert_id] = el.tokens
    knobs = {"top_k": st.knobs.top_k if st.knobs.HasField("top_k") else None,
             "capacity_factor": st.knobs.capacity_factor if st.knobs.HasField("capacity_factor") else None}
    return {
        "available": True,
        "placement_version": st.placement_version,
        "balancedness": st.balancedness,
        "window_tokens": st.window_tokens,
        "switching": st.switching,
        "knobs": knobs,
        "servers": [
            {"id": s.server.server_id, "address": s.server.address, "state": STATE_NAMES.get(s.server.state, "unknown"),
             "device": s.server.device, "experts_held": s.experts_held, "window_tokens": s.window_tokens,
             "queue_depth": s.queue_depth, "busy_seconds": s.busy_seconds, "heartbeat_age_s": s.seconds_since_heartbeat,
             "gpu": {"name": s.gpu.name, "utilization": s.gpu.utilization, "memory_used_bytes": s.gpu.memory_used_bytes,
                     "memory_total_bytes": s.gpu.memory_total_bytes, "power_watts": s.gpu.power_watts} if s.gpu.available else None}
            for s in st.servers
        ],
        "replicas": [{"id": r.replica_id, "address": r.address, "adopted_version": r.adopted_version, "alive": r.alive}
                     for r in st.replicas],
        "layers": layers,
        "num_experts": num_experts,
        "load": heat,
        "placement": [[list(e.server_ids) for e in lp.experts] for lp in st.placement.layers],
    }


class MeshView:
    def __init__(self, control: str, rpc: RpcConfig, timeout_s: float = 3.0) -> None:
        self.control = control
        self.timeout_s = timeout_s
        self._channel = make_channel(control, rpc) if control else None
        self._stub = control_grpc.ControlServiceStub(self._channel) if self._channel is not None else None

    async def snapshot(self) -> dict:
        if self._stub is None:
            return {"available": False, "error": "no control plane configured (start the gateway with --control HOST:PORT)"}
        try:
            st = await self._stub.GetStatus(control_pb2.GetStatusRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            return {"available": False, "error": f"control plane {self.control}: {exc.code().name}: {exc.details()}"}
        return status_json(st)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
