"""The gateway process: `create_server(cfg) -> (GatewayServer, port)` and `run(cfg, stop)`.

At start the gateway asks the router which model it serves (waiting up to `connect_timeout_s`),
binds its port, and serves the app with uvicorn on the running (uv)loop. On `stop` uvicorn stops
accepting, in-flight requests get the grace period (`shutdown_grace_s`), then whatever is left is
cancelled, which cancels its Generate call.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time

import uvicorn

from gateway_svc.app import Gateway, build_app
from gateway_svc.calls import Generations
from gateway_svc.config import GatewayConfig
from gateway_svc.mesh_view import MeshView
from moemesh.errors import MeshError
from moemesh.rpc.generation import GenerationClient
from moemesh.rpc.server import print_ready
from moemesh.telemetry import ServiceMetrics

def effective_api_key(cfg: GatewayConfig, env=os.environ) -> str:
    """--api-key (or MOEMESH_GATEWAY_API_KEY), else MOEMESH_API_KEY, else none."""
    return cfg.api_key or env.get("MOEMESH_API_KEY", "")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (0 = any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        """The process's own handlers (run_service) decide when to stop; uvicorn installs none."""
        yield


class GatewayServer:
    """uvicorn serving the app on a bound socket, plus the clients the app holds."""

    def __init__(self, cfg: GatewayConfig, gateway: Gateway, sock: socket.socket) -> None:
        self.cfg = cfg
        self.gateway = gateway
        self.sock = sock
        config = uvicorn.Config(
            build_app(gateway, effective_api_key(cfg)), lifespan="off", log_config=None, access_log=False,
            http="httptools", timeout_graceful_shutdown=max(1, round(cfg.rpc.shutdown_grace_s)),
        )
        self.uvicorn = _Uvicorn(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Serves in a task; returns once uvicorn listens (RuntimeError if it fails to start)."""
        self._task = asyncio.create_task(self.uvicorn.serve(sockets=[self.sock]))
        while not self.uvicorn.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("gateway: the HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    @property
    def task(self) -> asyncio.Task | None:
        return self._task

    async def shutdown(self) -> None:
        """Stop accepting, let in-flight requests finish within the grace period, close the clients."""
        if self._task is not None:
            self.uvicorn.should_exit = True
            await self._task
        self.sock.close()
        await self.gateway.mesh.close()
        await self.gateway.client.close()


async def create_server(cfg: GatewayConfig) -> tuple[GatewayServer, int]:
    # one public API key guards both doors: the gateway's clients send it, the gateway sends it on
    client = GenerationClient(cfg.router, cfg.rpc, api_key=effective_api_key(cfg))
    try:
        info = await client.model_info(timeout=cfg.connect_timeout_s, wait_for_ready=True)
    except MeshError as exc:
        await client.close()
        raise ValueError(f"router: no answer from {cfg.router} within {cfg.connect_timeout_s:g} s ({exc})") from exc
    metrics = ServiceMetrics("gateway")
    gateway = Gateway(
        client=client, info=info, served=cfg.served_model_name or info.name,
        calls=Generations(client, cfg.request_timeout_s, metrics), mesh=MeshView(cfg.control, cfg.rpc),
        metrics=metrics, max_body_bytes=cfg.max_body_mb * 1024 * 1024,
        reasoning=cfg.reasoning_parser == "think", tools=cfg.tool_parser == "hermes", started=int(time.time()),
    )
    sock = bind(cfg.host, cfg.port)
    return GatewayServer(cfg, gateway, sock), sock.getsockname()[1]


async def run(cfg: GatewayConfig, stop: asyncio.Event) -> None:
    """Serve until `stop` is set, then drain. If the HTTP server dies on its own, raise (exit non-zero)."""
    server, port = await create_server(cfg)
    await server.start()
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    print_ready("gateway", f"{host}:{port}")
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({stopping, server.task}, return_when=asyncio.FIRST_COMPLETED)
        if server.task.done() and not stop.is_set():
            server.task.result()
            raise RuntimeError("gateway: the HTTP server stopped on its own")
    finally:
        stopping.cancel()
        await server.shutdown()
