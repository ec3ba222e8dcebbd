"""Assembling an expert server: device, shard, dist hub, servicer, gRPC server.

    server, port = create_server(cfg)     # bound, not started
    await server.start()
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from expert_svc.config import ExpertServerConfig
from expert_svc.dist_hub import DistHub
from expert_svc.servicer import ExpertServicer, expert_grpc
from expert_svc.shard import ExpertShard
from moemesh.rpc.server import MeshServer, Service, build_server
from moemesh.telemetry import GpuTelemetry, MetricsServer, ServiceMetrics
from moemesh.transport.base import ExpertRequest

SERVICE_NAME = "moemesh.v1.ExpertService"


@dataclass
class ExpertServerParts:
    server: MeshServer
    port: int
    shard: ExpertShard
    dist: DistHub | None
    cfg: ExpertServerConfig
    gpu: GpuTelemetry
    metrics: ServiceMetrics
    metrics_server: MetricsServer | None = None  # /metrics when cfg.metrics_port is set

    @property
    def address(self) -> str:
        return self.cfg.advertise_addr or f"{self.cfg.host}:{self.port}"


def select_device(spec: str) -> torch.device:
    """torch.device for "cpu" / "cuda:N"; for CUDA, makes N the current device before any allocation."""
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available() or device.index >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r} is not available on this machine")
        torch.cuda.set_device(device.index)
    return device


def counted(shard: ExpertShard) -> Callable[[ExpertRequest], torch.Tensor]:
    """shard.forward, counted as in flight while it runs (the dist links' handler; the gRPC servicer
    counts its calls itself)."""
    def forward(req: ExpertRequest) -> torch.Tensor:
        shard.stats.enter()
        try:
            return shard.forward(req)
        finally:
            shard.stats.leave()

    return forward


def build_expert_server(cfg: ExpertServerConfig) -> ExpertServerParts:
    device = select_device(cfg.device)
    gpu = GpuTelemetry.for_device(cfg.device)
    shard = ExpertShard.from_model_dir(cfg.model_dir, cfg.dtype, device, cfg.experts_dtype, cfg.slot_budget, cfg.load_window_s)
    metrics = ServiceMetrics("expert", load=shard.stats.load, gpu=gpu)
    shard.stats.metrics = metrics  # queue depth and busy time mirrored into /metrics
    if cfg.preload == "all":
        shard.load_all()
    dist = None
    if cfg.offers_dist:
        dist = DistHub(cfg.host, cfg.dist_port, device, cfg.dist_timeout_s, cfg.rpc.max_message_bytes, handler=counted(shard))
    pool = ThreadPoolExecutor(max_workers=cfg.compute_threads, thread_name_prefix="expert-compute")
    servicer = ExpertServicer(shard, pool, dist, gpu, inline_max_elements=cfg.inline_max_elements if cfg.compute_threads == 1 else 0)
    server = build_server(cfg.rpc, Service(expert_grpc.add_ExpertServiceServicer_to_server, servicer, SERVICE_NAME))
    port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    server.add_cleanup(lambda: pool.shutdown(wait=False, cancel_futures=True))
    if dist is not None:
        server.add_cleanup(dist.close)
    metrics_server = metrics.serve(cfg.metrics_port, cfg.host) if cfg.metrics_port is not None else None
    if metrics_server is not None:
        server.add_cleanup(metrics_server.stop)
    server.add_cleanup(gpu.close)
    return ExpertServerParts(server, port, shard, dist, cfg, gpu, metrics, metrics_server)


def create_server(cfg: ExpertServerConfig) -> tuple[MeshServer, int]:
    parts = build_expert_server(cfg)
    return parts.server, parts.port
