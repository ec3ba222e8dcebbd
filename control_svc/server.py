"""The control plane as a server: model shape, plane, servicer, gRPC server, /metrics, its loops.

    server, port = await create_server(cfg)   # bound, not started (port 0 picks a free one)
    await server.start()                      # serving; reaps silent servers, rebalances periodically
    await server.shutdown()                   # health NOT_SERVING, grace period, stop

`run(cfg, stop)` does that around `stop` and prints `moemesh control_svc: serving HOST:PORT
[metrics=HOST:PORT]` once serving.
"""
from __future__ import annotations

import asyncio

from control_svc.config import ControlConfig
from control_svc.cost_model import ExpertShape
from control_svc.expert_ops import GrpcExpertOps
from control_svc.plane import ControlPlane
from control_svc.servicer import SERVICE_NAME, ControlServicer
from moemesh.contracts.wire import control_grpc
from moemesh.config import ModelConfig
from moemesh.models.registry import load_model_config
from moemesh.rpc.server import MeshServer, Service, build_server, print_ready
from moemesh.telemetry import MetricsServer, ServiceMetrics


class ControlServer:
    """The gRPC server, the plane, the client it calls expert servers with, and /metrics."""

    def __init__(self, mesh: MeshServer, port: int, plane: ControlPlane, ops: GrpcExpertOps, cfg: ControlConfig,
                 metrics_server: MetricsServer | None) -> None:
        self.mesh = mesh
        self.port = port
        self.plane = plane
        self.ops = ops
        self.cfg = cfg
        self.metrics_server = metrics_server  # /metrics when cfg.metrics_port is set
        self._loops: list[asyncio.Task] = []

    @property
    def address(self) -> str:
        return f"{self.cfg.host}:{self.port}"

    async def start(self) -> None:
        await self.mesh.start()
        self._loops.append(asyncio.create_task(self.plane.reap_forever()))
        if self.cfg.rebalance_interval_s > 0:
            self._loops.append(asyncio.create_task(self.plane.rebalance_forever()))

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Stops the loops; health NOT_SERVING, in-flight calls get the grace period; closes the channels."""
        for task in self._loops:
            task.cancel()
        await self.mesh.shutdown(grace_s)
        await self.ops.close()
        self.plane.close()


def expert_shape(model: ModelConfig) -> ExpertShape:
    """The cost model's view of the model's experts (weights and activations in its dtype)."""
    size = model.dtype.itemsize
    return ExpertShape(model.hidden_size, model.moe_intermediate_size, size, size, model.top_k)


async def create_server(cfg: ControlConfig) -> tuple[ControlServer, int]:
    model = load_model_config(cfg.model_dir)
    if model.num_experts <= 0:
        raise ValueError(f"model_dir {cfg.model_dir!r} holds a dense model: no experts to place")
    ops = GrpcExpertOps(cfg.rpc, cfg.prepare_timeout_s)
    metrics = ServiceMetrics("control")
    plane = ControlPlane(model.moe_layers, model.num_experts, cfg, ops, metrics=metrics, shape=expert_shape(model))
    mesh = build_server(cfg.rpc, Service(control_grpc.add_ControlServiceServicer_to_server, ControlServicer(plane), SERVICE_NAME))
    port = mesh.bind(f"{cfg.host}:{cfg.port}")
    metrics_server = metrics.serve(cfg.metrics_port, cfg.host) if cfg.metrics_port is not None else None
    if metrics_server is not None:
        mesh.add_cleanup(metrics_server.stop)
    return ControlServer(mesh, port, plane, ops, cfg, metrics_server), port


async def run(cfg: ControlConfig, stop: asyncio.Event) -> None:
    """Serve until `stop` is set, then drain (health NOT_SERVING, grace period)."""
    server, port = await create_server(cfg)
    await server.start()
    try:
        print_ready("control", server.address, metrics=server.metrics_server and f"{cfg.host}:{server.metrics_server.port}")
        await stop.wait()
    finally:
        await server.shutdown()
