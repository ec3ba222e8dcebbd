"""The router as a server: discovery, replica clients, router, servicer, gRPC server, /metrics.

    server, port = await create_server(cfg)   # bound, not started (port 0 picks a free one)
    await server.start()                      # polls the replicas' load, follows discovery
    await server.shutdown()                   # health NOT_SERVING, in-flight streams get the grace period

`run(cfg, stop)` does that around `stop` and prints `moemesh router_svc: serving HOST:PORT
[metrics=HOST:PORT]` once serving.

At start the router resolves the configured attention addresses into replicas (`Discovery`: a name
stands for all its A/AAAA records), asks them what model they serve (waiting for them up to
`connect_timeout_s`), loads that model's tokenizer, then polls every replica's load and re-resolves
the names every `discovery_interval_s`.
"""
from __future__ import annotations

import asyncio
import logging

import grpc
from dataclasses import replace
from pathlib import Path

from moemesh.rpc.security import api_key_credential
from moemesh.rpc.server import NOT_SERVING, SERVING, MeshServer, Service, build_server, print_ready
from moemesh.telemetry import MetricsServer, ServiceMetrics
from router_svc.admission import Admission
from router_svc.attention_client import AttentionClient
from router_svc.config import RouterConfig
from router_svc.discovery import Discovery, Resolver, dns_resolve
from router_svc.replicas import Replica, ReplicaSet
from router_svc.router import Router
from router_svc.servicer import SERVICE_NAME, GenerationServicer, add_to_server

log = logging.getLogger(__name__)


def load_tokenizer(model_dir: str):
    """The model's tokenizer, or None when the directory has no tokenizer.json (token ids only)."""
    from moemesh.tokenizer import Tokenizer

    if not (Path(model_dir) / "tokenizer.json").is_file():
        log.warning("%s has no tokenizer.json: the router accepts prompt_token_ids only", model_dir)
        return None
    return Tokenizer.from_model_dir(model_dir)


class RouterServer:
    """The gRPC server plus the replica clients, load poller, discovery and /metrics it owns."""

    def __init__(self, mesh: MeshServer, port: int, router: Router, discovery: Discovery, make_client, cfg: RouterConfig,
                 metrics: ServiceMetrics, metrics_server: MetricsServer | None) -> None:
        self.mesh = mesh
        self.port = port
        self.router = router
        self.discovery = discovery
        self.make_client = make_client
        self.cfg = cfg
        self.metrics = metrics
        self.metrics_server = metrics_server  # /metrics when cfg.metrics_port is set
        self._tasks: list[asyncio.Task] = []
        self._health: asyncio.Task | None = None

    async def track_health(self) -> None:
        """The Generation service's health follows the replicas: SERVING only while one is available
        (the overall "" status stays the process's own, which the launcher and liveness probes read)."""
        serving = None
        while True:
            now = self.router.serving
            if now != serving:
                await self.mesh.health.set(SERVICE_NAME, SERVING if now else NOT_SERVING)
                serving = now
            await asyncio.sleep(self.cfg.load_poll_s)

    @property
    def address(self) -> str:
        return f"{self.cfg.host}:{self.port}"

    async def start(self) -> None:
        cfg = self.cfg
        await self.router.replicas.refresh(timeout=5.0)
        self._tasks.append(asyncio.create_task(self.router.replicas.poll_forever(cfg.load_poll_s)))
        if cfg.discovery_interval_s > 0 and self.discovery.has_names:
            self._tasks.append(asyncio.create_task(
                self.discovery.run_forever(self.router.replicas, self.make_client, cfg.discovery_interval_s, max(cfg.load_poll_s, 1.0))
            ))
        if self.metrics_server is not None:
            self._tasks.append(asyncio.create_task(self._refresh_gauges()))
        await self.mesh.start()
        self._health = asyncio.create_task(self.track_health())

    async def _refresh_gauges(self) -> None:
        """The queue depth on /metrics, refreshed every poll period."""
        while True:
            self.metrics.set_queue_depth(self.router.admission.queued)
            await asyncio.sleep(self.cfg.load_poll_s)

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Health NOT_SERVING, new calls UNAVAILABLE, in-flight streams get the grace period."""
        if self._health is not None:
            self._health.cancel()
        await self.mesh.shutdown(grace_s)
        for task in self._tasks:
            task.cancel()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        await self.router.replicas.close()


async def create_server(cfg: RouterConfig, resolver: Resolver = dns_resolve) -> tuple[RouterServer, int]:
    discovery = Discovery(cfg.attention_addresses, resolver)

    def make_client(address: str) -> AttentionClient:  # carries the mesh token: replicas are internal
        return AttentionClient(address, cfg.rpc)

    clients = [make_client(a) for a in await discovery.wait_for_addresses(cfg.connect_timeout_s)]

    async def ask(client: AttentionClient):
        try:
            return await client.get_info(timeout=cfg.connect_timeout_s, name=cfg.model_name)
        except grpc.RpcError as exc:
            raise ConnectionError(f"attention: replica {client.address} did not answer within {cfg.connect_timeout_s:g}s "
                                  f"({exc.code().name}: {exc.details()})") from exc

    info = await ask(clients[0])
    for c in clients[1:]:
        other = await ask(c)
        if other.vocab_size != info.vocab_size or other.architecture != info.architecture:
            raise ValueError(f"attention: replica {c.address} serves a different model than {clients[0].address}")
    tokenizer = load_tokenizer(cfg.model_dir or info.model_dir)
    info = replace(info, has_chat_template=bool(tokenizer and tokenizer.has_chat_template))
    replicas = ReplicaSet([Replica(c.address, c) for c in clients], cfg.prefix_imbalance if cfg.prefix_routing else None)
    router = Router(info, replicas, Admission(cfg.max_running, cfg.max_queued), tokenizer)
    # the public API asks for the API key (when one is set), never the mesh token; a request longer than
    # any valid one is refused by gRPC unread (router_svc/limits.py)
    mesh = build_server(cfg.rpc, Service(add_to_server, GenerationServicer(router), SERVICE_NAME),
                        credential=api_key_credential(cfg.api_key), max_receive_bytes=router.limits.message_bytes)
    port = mesh.bind(f"{cfg.host}:{cfg.port}")
    metrics = ServiceMetrics("router")
    metrics_server = metrics.serve(cfg.metrics_port, cfg.host) if cfg.metrics_port is not None else None
    return RouterServer(mesh, port, router, discovery, make_client, cfg, metrics, metrics_server), port


async def run(cfg: RouterConfig, stop: asyncio.Event) -> None:
    """Serve until `stop` is set, then drain (health NOT_SERVING, grace period)."""
    server, _ = await create_server(cfg)
    await server.start()
    try:
        print_ready("router", server.address, metrics=server.metrics_server and f"{cfg.host}:{server.metrics_server.port}")
        await stop.wait()
    finally:
        await server.shutdown()
