"""Building, running and stopping the mesh's gRPC servers, and channels with the same limits and credentials.

    server = build_server(cfg.rpc, Service(expert_pb2_grpc.add_ExpertServiceServicer_to_server,
                                           servicer, "moemesh.v1.ExpertService"))
    port = server.bind("127.0.0.1:0")   # TLS when cfg.rpc.security has certificates
    await server.start()          # health: NOT_SERVING -> SERVING
    ...
    await server.shutdown()       # health NOT_SERVING, stop accepting, grace period, stop

Every server carries grpc.health.v1 (overall "" and per service) and server reflection, and
requires a credential of every call but the health checks (`moemesh.rpc.security`): the mesh
token by default, the router's API key for the public API. `make_channel` / `make_sync_channel`
build the client side: TLS and the credentials' metadata from the same `RpcConfig`.
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

from moemesh.errors import USAGE_ERRORS, ServiceFailed
from moemesh.rpc.config import RpcConfig
from moemesh.rpc.security import Credential, RequireCredential, SyncMetadata, aio_interceptors, mesh_token_credential

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class Service:
    """One servicer to add: `add(servicer, server)` is the generated `add_XServicer_to_server`."""

    add: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    name: str  # full proto name, e.g. "moemesh.v1.ExpertService"


class MeshServer:
    """A `grpc.aio.Server` (start/stop/wait_for_termination) with health, the credential check and,
    with `cfg.health_port`, a plaintext server of the health service alone (for probes)."""

    def __init__(self, cfg: RpcConfig, services: tuple[Service, ...], credential: Credential,
                 max_receive_bytes: int | None = None):
        self.cfg = cfg
        self.credential = credential
        self.service_names = tuple(s.name for s in services)
        options = cfg.server_options()
        if max_receive_bytes is not None:  # a tighter bound for this server (gRPC refuses longer messages unread)
            limit = min(max_receive_bytes, cfg.max_message_bytes)
            options = [(k, limit if k == "grpc.max_receive_message_length" else v) for k, v in options]
        interceptors = [RequireCredential(credential)] if credential.secret else []
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        self.health = health.aio.HealthServicer()
        self.health_server: grpc.aio.Server | None = None
        self.health_port = 0
        self._cleanups: list[Callable[[], None]] = []
        for s in services:
            s.add(s.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server,
        )

    def bind(self, address: str) -> int:
        """Listen on `address` (TLS when the config has certificates); returns the port. With
        `health_port` set, the plaintext health server binds that port on the same host."""
        creds = self.cfg.security.server_credentials()
        port = self.server.add_secure_port(address, creds) if creds else self.server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot bind gRPC server to {address}")
        if self.cfg.health_port is not None:
            self.health_server = grpc.aio.server(options=self.cfg.server_options())
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            host = address.rsplit(":", 1)[0]
            self.health_port = self.health_server.add_insecure_port(f"{host}:{self.cfg.health_port}")
            if self.health_port == 0:
                raise OSError(f"cannot bind the health server to {host}:{self.cfg.health_port}")
        return port

    async def start(self) -> None:
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
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
        if self.health_server is not None:
            await self.health_server.stop(0)
        cleanups, self._cleanups = self._cleanups, []
        for fn in reversed(cleanups):
            fn()

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        return await self.server.wait_for_termination(timeout)


def build_server(cfg: RpcConfig, *services: Service, credential: Credential | None = None,
                 max_receive_bytes: int | None = None) -> MeshServer:
    """A server with `services`, health, reflection and cfg's message limits (received messages
    bounded further by `max_receive_bytes` when given) and keepalive, requiring `credential` of
    every call but the health checks (default: the mesh token of `cfg.security`; ValueError when
    there is none and `insecure_no_auth` is not set). Build it on the event loop that will run it
    (inside a coroutine, or before `asyncio.run` ends)."""
    if credential is None:
        cfg.security.require_token()
        credential = mesh_token_credential(cfg.security)
    return MeshServer(cfg, services, credential, max_receive_bytes)


def _check_address(address: str) -> None:
    if not address or ":" not in address:
        raise ValueError(f"address must be host:port, got {address!r}")


def make_channel(address: str, cfg: RpcConfig, api_key: str = "") -> grpc.aio.Channel:
    """An aio channel to `address` with the servers' limits: TLS when `cfg.security` has
    certificates, every call carrying the mesh token (when configured) and `api_key` (when given).
    The HTTP gateway builds its channel to the router with this."""
    _check_address(address)
    sec = cfg.security
    options = cfg.channel_options() + sec.channel_options()
    interceptors = aio_interceptors(sec.call_metadata(api_key))
    creds = sec.channel_credentials()
    if creds is not None:
        return grpc.aio.secure_channel(address, creds, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


def make_sync_channel(address: str, cfg: RpcConfig, api_key: str = "") -> grpc.Channel:
    """`make_channel` for synchronous code (the CLI, the expert transports, the launcher)."""
    _check_address(address)
    sec = cfg.security
    options = cfg.channel_options() + sec.channel_options()
    creds = sec.channel_credentials()
    channel = grpc.secure_channel(address, creds, options=options) if creds is not None else grpc.insecure_channel(address, options=options)
    metadata = sec.call_metadata(api_key)
    return grpc.intercept_channel(channel, SyncMetadata(metadata)) if metadata else channel


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


def serve_process(main: Callable[[asyncio.Event], Awaitable[None]], prog: str = "moemesh service") -> NoReturn:
    """A service process (`python -m x_svc`, `moemesh serve x`): logs to stderr, runs `main(stop)`
    until SIGTERM/SIGINT sets `stop` (main then drains and returns), then ends the process.
    Exit status: 0 after a drain; 2 when it could not start for a bad flag, file or value
    (`USAGE_ERRORS`); 1 when it failed (`ServiceFailed`: restart it) or broke. An error is one line
    on stderr, `{prog}: error: ...`, never a traceback."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        run_service(main)
    except ServiceFailed as exc:
        code, text = 1, str(exc)
    except USAGE_ERRORS as exc:
        code, text = 2, str(exc) or type(exc).__name__
    except grpc.RpcError as exc:  # a call the service depends on failed
        code, text = 1, f"{exc.code().name}: {exc.details()}" if hasattr(exc, "code") else str(exc)
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback; the supervisor restarts it
        code, text = 1, f"{type(exc).__name__}: {exc}"
    else:
        exit_process(0)
    print(f"{prog}: error: {' '.join(text.split())}", file=sys.stderr, flush=True)
    exit_process(code)


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
