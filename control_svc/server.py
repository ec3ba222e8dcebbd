"""Assembling the control plane: model shape, plane, servicer, gRPC server.

    server, port = create_server(cfg)     # bound, not started; build it on the loop that runs it
    await server.start()
"""
from __future__ import annotations

from dataclasses import dataclass

from control_svc.config import ControlConfig
from control_svc.expert_ops import GrpcExpertOps
from control_svc.plane import ControlPlane
from control_svc.servicer import SERVICE_NAME, ControlServicer
from moemesh.config import ModelConfig
from moemesh.contracts.wire import control_grpc
from moemesh.rpc.server import MeshServer, Service, build_server
from moemesh.telemetry import MetricsServer, ServiceMetrics


@dataclass
class ControlServerParts:
    server: MeshServer
    port: int
    plane: ControlPlane
    ops: GrpcExpertOps
    cfg: ControlConfig
    metrics: ServiceMetrics
    metrics_server: MetricsServer | None = None  # /metrics when cfg.metrics_port is set

    @property
    def address(self) -> str:
        return f"{self.cfg.host}:{self.port}"


def build_control_server(cfg: ControlConfig) -> ControlServerParts:
    model = ModelConfig.from_model_dir(cfg.model_dir)
    if model.num_experts <= 0:
        raise ValueError(f"model_dir {cfg.model_dir!r} holds a dense model: no experts to place")
    ops = GrpcExpertOps(cfg.rpc, cfg.prepare_timeout_s)
    metrics = ServiceMetrics("control")
    plane = ControlPlane(model.moe_layers, model.num_experts, cfg, ops, metrics=metrics)
    server = build_server(cfg.rpc, Service(control_grpc.add_ControlServiceServicer_to_server, ControlServicer(plane), SERVICE_NAME))
    port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    metrics_server = metrics.serve(cfg.metrics_port, cfg.host) if cfg.metrics_port is not None else None
    if metrics_server is not None:
        server.add_cleanup(metrics_server.stop)
    return ControlServerParts(server, port, plane, ops, cfg, metrics, metrics_server)


def create_server(cfg: ControlConfig) -> tuple[MeshServer, int]:
    parts = build_control_server(cfg)
    return parts.server, parts.port
