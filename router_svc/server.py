"""The router process: `create_server(cfg) -> (RouterServer, port)` and `serve(cfg)`.

At start the router resolves the configured attention addresses into replicas (`Discovery`: a name
stands for all its A/AAAA records), asks them what model they serve (waiting for them up to
`connect_timeout_s`), loads that model's tokenizer, then polls every replica's load and re-resolves
the names every `discovery_interval_s`.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from moemesh.rpc.server import MeshServer, Service, build_server, run_service
from moemesh.telemetry import MetricsServer, ServiceMetrics
from router_svc.admission import Admission
from router_svc.attention_client import AttentionClient
from router_svc.config import RouterConfig
from router_svc.discovery import Discovery, Resolver, dns_resolve
from router_svc.replicas import Replica, ReplicaSet
from router_svc.router import Router
from router_svc.servicer import SERVICE_NAME, GenerationServicer, add_to_server
from router_svc.types import ModelInfo

log = logging.getLogger(__name__)


def load_tokenizer(model_dir: str):
    """The model's tokenizer, or None when the directory has no tokenizer.json (token ids only)."""
    from moemesh.tokenizer import Tokenizer

    if not (Path(model_dir) / "tokenizer.json").is_file():
        log.warning("%s has no tokenizer.json: the router accepts prompt_token_ids only", model_dir)
        return None
    return Tokenizer.from_model_dir(model_dir)


class RouterServer:
    """The gRPC server plus the replica clients and load poller it owns."""

    def __init__(self, mesh: MeshServer, router: Router, discovery: Discovery, make_client, poll_s: float, discovery_s: float) -> None:
        self.mesh = mesh
        self.router = router
        self.discovery = discovery
        self.make_client = make_client
        self.poll_s = poll_s
        self.discovery_s = discovery_s
        self._poller: asyncio.Task | None = None
        self._discoverer: asyncio.Task | None = None
        self.metrics = ServiceMetrics("router")
        self.metrics_server: MetricsServer | None = None  # /metrics when serve_metrics() was called
        self._gauges: asyncio.Task | None = None

    def serve_metrics(self, port: int, host: str) -> None:
        """/metrics on host:port (0 = any free port); the queue depth is refreshed every poll period."""
        self.metrics_server = self.metrics.serve(port, host)

        async def refresh() -> None:
            while True:
                self.metrics.set_queue_depth(self.router.admission.queued)
                await asyncio.sleep(self.poll_s)

        self._gauges = asyncio.create_task(refresh())

    async def start(self) -> None:
        await self.router.replicas.refresh(timeout=5.0)
        self._poller = asyncio.create_task(self.router.replicas.poll_forever(self.poll_s))
        if self.discovery_s > 0 and self.discovery.has_names:
            self._discoverer = asyncio.create_task(
                self.discovery.run_forever(self.router.replicas, self.make_client, self.discovery_s, max(self.poll_s, 1.0))
            )
        await self.mesh.start()

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Health NOT_SERVING, new calls UNAVAILABLE, in-flight streams get the grace period."""
        await self.mesh.shutdown(grace_s)
        for task in (self._poller, self._discoverer, self._gauges):
            if task is not None:
                task.cancel()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        await self.router.replicas.close()


async def create_server(cfg: RouterConfig, resolver: Resolver = dns_resolve) -> tuple[RouterServer, int]:
    discovery = Discovery(cfg.attention_addresses, resolver)

    def make_client(address: str) -> AttentionClient:
        return AttentionClient(address, cfg.rpc)

    clients = [make_client(a) for a in await discovery.wait_for_addresses(cfg.connect_timeout_s)]
    info, model_dir = await clients[0].get_info(timeout=cfg.connect_timeout_s, name=cfg.model_name)
    for c in clients[1:]:
        other, _ = await c.get_info(timeout=cfg.connect_timeout_s, name=cfg.model_name)
        if other.vocab_size != info.vocab_size or other.architecture != info.architecture:
            raise ValueError(f"attention: replica {c.address} serves a different model than {clients[0].address}")
    tokenizer = load_tokenizer(cfg.model_dir or model_dir)
    info = ModelInfo(**{**info.__dict__, "has_chat_template": bool(tokenizer and tokenizer.has_chat_template)})
    replicas = ReplicaSet([Replica(c.address, c) for c in clients], cfg.prefix_imbalance if cfg.prefix_routing else None)
    router = Router(info, replicas, Admission(cfg.max_running, cfg.max_queued), tokenizer)
    mesh = build_server(cfg.rpc, Service(add_to_server, GenerationServicer(router), SERVICE_NAME))
    port = mesh.add_insecure_port(f"{cfg.host}:{cfg.port}")
    return RouterServer(mesh, router, discovery, make_client, cfg.load_poll_s, cfg.discovery_interval_s), port


async def run(cfg, stop: asyncio.Event) -> None:
    """Serve until `stop` is set, then drain gracefully (health NOT_SERVING, grace period)."""
    server, port = await create_server(cfg)
    await server.start()
    if cfg.metrics_port is not None:
        server.serve_metrics(cfg.metrics_port, cfg.host)
    try:
        extra = f" metrics={cfg.host}:{server.metrics_server.port}" if server.metrics_server else ""
        print(f"moemesh router_svc: serving {cfg.host}:{port}{extra}", flush=True)
        await stop.wait()
    finally:
        await server.shutdown()


def serve(cfg) -> None:
    """Run the router until SIGTERM/SIGINT."""
    run_service(lambda stop: run(cfg, stop))
