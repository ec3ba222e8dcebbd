"""Building, running and stopping the mesh's gRPC servers, and channels with the same limits.

    server = build_server(cfg.rpc, Service(expert_pb2_grpc.add_ExpertServiceServicer_to_server,
                                           servicer, "moemesh.v1.ExpertService"))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()          # health: NOT_SERVING -> SERVING
    ...
    await server.shutdown()       # health NOT_SERVING, stop accepting, grace period, stop

Every server carries grpc.health.v1 (overall "" and per service) and server reflection.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from moemesh.rpc.config import RpcConfig

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class Service:
    """One servicer to add: `add(servicer, server)` is the generated `add_XServicer_to_server`."""

    add: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    name: str  # full proto name, e.g. "moemesh.v1.ExpertService"


class MeshServer:
    """A `grpc.aio.Server` (same start/stop/add_insecure_port/wait_for_termination) with health."""

    def __init__(self, cfg: RpcConfig, services: tuple[Service, ...]):
        self.cfg = cfg
        self.service_names = tuple(s.name for s in services)
        self.server = grpc.aio.server(options=cfg.server_options())
        self.health = health.aio.HealthServicer()
        self._cleanups: list[Callable[[], None]] = []
        for s in services:
            s.add(s.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server,
        )

    def add_insecure_port(self, address: str) -> int:
        port = self.server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot bind gRPC server to {address}")
        return port

    async def start(self) -> None:
        await self.server.start()
        await self.set_serving(True)

    async def set_serving(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    def add_cleanup(self, fn: Callable[[], None]) -> None:
        """Run `fn()` once the server has stopped (release pools, stores, files)."""
        self._cleanups.append(fn)

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Health NOT_SERVING, refuse new calls, give in-flight ones `grace_s`, stop, clean up."""
        await self.set_serving(False)
        await self.stop(self.cfg.shutdown_grace_s if grace_s is None else grace_s)

    async def stop(self, grace: float | None) -> None:
        await self.server.stop(grace)
        cleanups, self._cleanups = self._cleanups, []
        for fn in reversed(cleanups):
            fn()

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        return await self.server.wait_for_termination(timeout)


def build_server(cfg: RpcConfig, *services: Service) -> MeshServer:
    """A server with `services`, health, reflection and cfg's message limits and keepalive.
    Build it on the event loop that will run it (inside a coroutine, or before `asyncio.run` ends)."""
    return MeshServer(cfg, services)


def make_channel(address: str, cfg: RpcConfig) -> grpc.aio.Channel:
    """An insecure aio channel to `address` with the same limits as the servers."""
    if not address or ":" not in address:
        raise ValueError(f"address must be host:port, got {address!r}")
    return grpc.aio.insecure_channel(address, options=cfg.channel_options())


def exit_process(code: int = 0) -> NoReturn:
    """Ends a service process once it has drained and stopped: flush logs and stdio, then
    `os._exit`. Skips the exit-time teardown of native libraries, which can abort a process whose
    gloo/NCCL pair groups or gRPC threads are still winding down ("terminate called without an
    active exception", seen when a dist link closed just before SIGTERM)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to flush
            pass
    os._exit(code)


def print_ready(service: str, address: str, **extra: object) -> None:
    """The line a service prints once it serves (launchers and tests wait for it), flushed:
    `moemesh <service>_svc: serving HOST:PORT [name=VALUE ...]`; empty values are left out."""
    fields = "".join(f" {name}={value}" for name, value in extra.items() if value)
    print(f"moemesh {service}_svc: serving {address}{fields}", flush=True)


def serve_process(main: Callable[[asyncio.Event], Awaitable[None]]) -> NoReturn:
    """A service process (`python -m x_svc`, `moemesh serve x`): logs to stderr, runs `main(stop)`
    until SIGTERM/SIGINT sets `stop` (main then drains and returns), then ends the process."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    run_service(main)
    exit_process(0)


def run_service(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stop)` on a uvloop loop; SIGTERM/SIGINT set `stop` (main then drains and returns)."""
    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    try:
        import uvloop
    except ImportError:  # uvloop is not built for every platform
        asyncio.run(runner())
        return
    uvloop.run(runner())
