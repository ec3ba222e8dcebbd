"""An expert server: device, shard, dist hub, servicer, gRPC server, /metrics and, with a control
plane, its registration.

    server, port = await create_server(cfg)   # bound, not started (port 0 picks a free one)
    await server.start()                      # serving; registered and heartbeating with --control-addr
    await server.shutdown()                   # the drain below, then stop

`run(cfg, stop)` does that around `stop` and prints `moemesh expert_svc: serving HOST:PORT
[dist=HOST:PORT] [id=SERVER_ID] [metrics=HOST:PORT]` once serving. The drain (SIGTERM): health
NOT_SERVING, tell the control plane (which moves this server's experts to the others when they have
room, and drops them here once attention runs on the new placement), let in-flight calls finish
(all within `--drain-timeout-s`), deregister, stop.
"""
from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from expert_svc.config import ExpertServerConfig
from expert_svc.control_agent import ControlAgent
from expert_svc.dist_hub import DistHub
from expert_svc.load_pacing import LoadPacer
from expert_svc.servicer import SERVICE_NAME, ExpertServicer, expert_grpc, stats_message
from expert_svc.shard import ExpertShard
from moemesh.contracts.info import ServerInfo
from moemesh.engine.device import select_device
from moemesh.rpc.server import MeshServer, Service, build_server, print_ready
from moemesh.telemetry import GpuTelemetry, MetricsServer, ServiceMetrics
from moemesh.telemetry.cpu_limit import cpu_limit
from moemesh.transport.base import ExpertRequest

log = logging.getLogger("expert_svc")
STOP_GRACE_S = 1.0  # after the drain, the grace of calls other than expert calls


class ExpertServer:
    """The gRPC server, the shard it serves, the dist hub, GPU telemetry, /metrics and the control agent."""

    def __init__(self, mesh: MeshServer, port: int, shard: ExpertShard, dist: DistHub | None, cfg: ExpertServerConfig,
                 gpu: GpuTelemetry, metrics: ServiceMetrics, metrics_server: MetricsServer | None, servicer: ExpertServicer) -> None:
        self.mesh = mesh
        self.servicer = servicer
        self.port = port
        self.shard = shard
        self.dist = dist
        self.cfg = cfg
        self.gpu = gpu
        self.metrics = metrics
        self.metrics_server = metrics_server  # /metrics when cfg.metrics_port is set
        self.agent: ControlAgent | None = None  # registered with the control plane (cfg.control_addr)
        self._beats: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return self.cfg.advertise_addr or f"{self.cfg.host}:{self.port}"

    def info(self) -> ServerInfo:
        """This server as it registers with the control plane (the id is the control plane's to give)."""
        return ServerInfo(
            server_id="", address=self.address, device=self.cfg.device, memory_bytes=self.cfg.memory_bytes,
            slot_budget=self.cfg.slot_budget, host_id=self.dist.host_id if self.dist else "", dist_addr=self.dist.addr if self.dist else "",
        )

    async def start(self) -> None:
        """Serve; with a control plane, register (loading what its placement already gives this
        server, for a re-registered one) and heartbeat."""
        await self.mesh.start()
        if not self.cfg.control_addr:
            return
        try:
            self.attach(ControlAgent(self.cfg.control_addr, self.cfg.rpc, self.info(), lambda: stats_message(self.shard, gpu=self.gpu),
                                     self.shard.held))
            placement = await self.agent.register()
            await self._load_placed(placement)
            self._beats = asyncio.create_task(self.agent.heartbeat_forever(self._registered_again))
        except BaseException:
            await self._close()
            raise

    def attach(self, agent: ControlAgent) -> None:
        """Talk to the control plane through `agent`: drops are checked with it, and the placement
        version of every LoadExperts / DropExperts counts as heard of (a server holding copies a
        control plane loaded for a placement reports it when it registers again, even if no heartbeat
        told it that placement was committed before that control plane went away)."""
        self.agent = agent
        self.servicer.drop_guard = agent.check_drop
        self.servicer.version_seen = agent.heard_of

    async def _load_placed(self, placement) -> None:
        for layer, experts in placement.experts_on(self.agent.server_id).items():
            await asyncio.to_thread(self.shard.load, layer, experts)

    async def _registered_again(self, placement) -> None:
        """After registering again: with a placement (the control plane had declared this server dead,
        or rebuilt its placement before this server came back), the copies it does not give this
        server are stale: dropped, so they hold no slots the control plane counts as free, and those
        it gives are loaded. Without one (a restarted control plane rebuilding from what the servers
        hold) everything stays. An expert a LoadExperts or DropExperts changed for a newer placement
        meanwhile (the join rebalance the registration started) is left as that call made it."""
        if placement.version == 0:
            return
        async with self.servicer.changing:
            def newer(layer: int, e: int) -> bool:
                return self.servicer.changed_at.get((layer, e), 0) > placement.version

            placed = placement.experts_on(self.agent.server_id)
            for layer, experts in self.shard.held().items():
                stale = [e for e in experts if e not in placed.get(layer, ()) and not newer(layer, e)]
                if stale:
                    log.info("dropping layer %d experts %s: placement v%d does not give them to %s", layer, stale, placement.version,
                             self.agent.server_id)
                    await asyncio.to_thread(self.shard.drop, layer, stale)
            for layer, experts in placed.items():
                wanted = [e for e in experts if not newer(layer, e)]
                if wanted:
                    await asyncio.to_thread(self.shard.load, layer, wanted)

    async def drain(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        await self.mesh.set_serving(False)
        if self.agent and await self.agent.drain():
            # the control plane switches in a placement without us and drops our experts at release,
            # once every attention replica runs on it: until then we keep answering
            while self.shard.held() and loop.time() < deadline and await self.agent.still_moving():
                await asyncio.sleep(0.05)
        while self.shard.stats.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self._beats:  # a heartbeat after deregistering would register this server again
            self._beats.cancel()
        if self.agent:
            await self.agent.deregister()
        # expert calls are done (or out of time); what is left is open ForwardStreams, which never end on
        # their own, and short calls (stats, health): give those a moment, not the whole drain timeout
        await self.mesh.stop(min(STOP_GRACE_S, max(0.0, deadline - loop.time())))
        log.info("drained: %d calls still in flight at stop", self.shard.stats.in_flight)

    async def shutdown(self, grace_s: float | None = None) -> None:
        """The drain, within `grace_s` (default `drain_timeout_s`), then stop."""
        try:
            await self.drain(self.cfg.drain_timeout_s if grace_s is None else grace_s)
        finally:
            await self._close()

    async def _close(self) -> None:
        if self._beats:
            self._beats.cancel()
        if self.agent:
            await self.agent.close()
        await self.mesh.stop(0)


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


async def create_server(cfg: ExpertServerConfig) -> tuple[ExpertServer, int]:
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    device = select_device(cfg.device)
    gpu = GpuTelemetry.for_device(cfg.device)
    shard = ExpertShard.from_model_dir(cfg.model_dir, cfg.dtype, device, cfg.experts_dtype, cfg.slot_budget, cfg.load_window_s,
                                       all_experts_path=cfg.all_experts_path)
    shard.stats.cpu_limit = cpu_limit() if device.type == "cpu" else None  # the budget the cost model holds its CPU demand to
    metrics = ServiceMetrics("expert", load=shard.stats.load, gpu=gpu)
    shard.stats.metrics = metrics  # queue depth and busy time mirrored into /metrics
    if cfg.preload == "all":
        shard.load_all()
    dist = None
    if cfg.offers_dist:
        dist = DistHub(cfg.host, cfg.dist_port, device, cfg.dist_timeout_s, cfg.rpc.max_message_bytes, handler=counted(shard))
    pool = ThreadPoolExecutor(max_workers=cfg.compute_threads, thread_name_prefix="expert-compute")
    cpus = shard.stats.cpu_limit or len(os.sched_getaffinity(0))
    servicer = ExpertServicer(shard, pool, dist, gpu, inline_max_elements=cfg.inline_max_elements if cfg.compute_threads == 1 else 0,
                              pacer=LoadPacer(cpus, cfg.load_cpu_share))
    mesh = build_server(cfg.rpc, Service(expert_grpc.add_ExpertServiceServicer_to_server, servicer, SERVICE_NAME))
    port = mesh.bind(f"{cfg.host}:{cfg.port}")
    mesh.add_cleanup(lambda: pool.shutdown(wait=False, cancel_futures=True))
    if dist is not None:
        mesh.add_cleanup(dist.close)
    metrics_server = metrics.serve(cfg.metrics_port, cfg.host) if cfg.metrics_port is not None else None
    if metrics_server is not None:
        mesh.add_cleanup(metrics_server.stop)
    mesh.add_cleanup(gpu.close)
    return ExpertServer(mesh, port, shard, dist, cfg, gpu, metrics, metrics_server, servicer), port


async def run(cfg: ExpertServerConfig, stop: asyncio.Event) -> None:
    """Serve until `stop` is set, then drain (above)."""
    server, _ = await create_server(cfg)
    await server.start()
    try:
        print_ready(
            "expert", server.address, dist=server.dist and server.dist.addr, id=server.agent and server.agent.server_id,
            metrics=server.metrics_server and f"{cfg.host}:{server.metrics_server.port}",
        )
        await stop.wait()
    finally:
        await server.shutdown()
