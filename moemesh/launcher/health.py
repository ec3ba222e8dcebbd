"""Waiting for a service to answer grpc.health.v1 with SERVING (or, for the HTTP gateway, its
`/health` with 200)."""
from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moemesh.rpc.config import RpcConfig
from moemesh.rpc.server import make_sync_channel


class ChildExited(RuntimeError):
    """A child process exited while the launcher waited for it."""


def wait_serving(address: str, timeout_s: float, alive=lambda: True, rpc: RpcConfig | None = None) -> None:
    """Polls `address` until SERVING (over TLS when `rpc` has certificates); raises ChildExited if
    `alive()` turns False, TimeoutError at the end."""
    deadline = time.monotonic() + timeout_s
    with make_sync_channel(address, rpc or RpcConfig()) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if not alive():
                raise ChildExited(address)
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} was not serving after {timeout_s:.0f}s")
            time.sleep(0.1)


def wait_http_ok(url: str, timeout_s: float, alive=lambda: True) -> None:
    """Polls `url` until it answers 200; raises ChildExited if `alive()` turns False, TimeoutError at the end."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        if not alive():
            raise ChildExited(url)
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer 200 within {timeout_s:.0f}s")
        time.sleep(0.1)
