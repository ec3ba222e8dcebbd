"""`Mesh`: the whole mesh on this machine as child processes.

    start: control -> expert servers -> attention replicas -> router (-> HTTP gateway), each healthy
           before the next
    watch: until asked to stop or a child exits on its own
    stop:  SIGTERM all (router first, so streams drain), then SIGKILL what is left
"""
from __future__ import annotations

import os
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from moemesh.launcher.child import Child, stop_all
from moemesh.launcher.health import ChildExited, wait_http_ok, wait_serving
from moemesh.launcher.ports import free_port


@dataclass(frozen=True)
class MeshSpec:
    model_dir: str
    expert_servers: int = 2
    attention_replicas: int = 1
    experts_dtype: str | None = None
    transport: str = "grpc"
    host: str = "127.0.0.1"
    port: int = 0  # the router's; 0 = any free port
    start_timeout_s: float = 300.0
    grace_s: float = 10.0
    attention_threads: int = 0  # 0 = this machine's cores split evenly over the compute processes
    http_port: int | None = None  # the HTTP gateway's; None = no gateway, 0 = any free port
    api_key: str = ""  # the gateway's API key (empty = none)
    prefix_cache: bool = True  # attention replicas reuse cached prompt prefixes
    max_num_batched_tokens: int = 0  # attention replicas' token budget per step; 0 = their default

    def threads_per_process(self) -> int:
        """torch threads for each expert server and attention replica: every process on this machine
        with as many OpenMP threads as cores spin-waits the others off the cores (a decode step
        several times slower), so the cores are split evenly, at least one each."""
        return max(1, (os.cpu_count() or 1) // (self.expert_servers + self.attention_replicas))

    def __post_init__(self) -> None:
        if self.expert_servers < 1:
            raise ValueError(f"expert_servers must be >= 1, got {self.expert_servers}")
        if self.attention_replicas < 1:
            raise ValueError(f"attention_replicas must be >= 1, got {self.attention_replicas}")
        if self.transport not in ("grpc", "dist", "auto"):
            raise ValueError(f"transport must be grpc, dist or auto, got {self.transport!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.max_num_batched_tokens < 0:
            raise ValueError(f"max_num_batched_tokens must be >= 0 (0 = the replicas' default), got {self.max_num_batched_tokens}")


class MeshFailed(RuntimeError):
    """A child failed to start or exited on its own; the message carries its log tail."""


def serve_argv(service: str, flags: dict[str, object]) -> list[str]:
    """The command line of `moemesh serve SERVICE` with `flags` (None or "" = left out; a bool is
    `--name` / `--no-name`)."""
    argv = [sys.executable, "-m", "moemesh.cli.main", "serve", service]
    for name, value in flags.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None and value != "":
            argv += [f"--{flag}", str(value)]
    return argv


class Mesh:
    def __init__(self, spec: MeshSpec, log_dir: Path | None = None) -> None:
        self.spec = spec
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="moemesh-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self.addresses: dict[str, str] = {}  # child name -> its gRPC address
        self.router_addr = ""
        self.control_addr = ""
        self.http_addr = ""  # the gateway's HOST:PORT when spec.http_port is set

    def _spawn(self, name: str, service: str, flags: dict[str, object]) -> str:
        s = self.spec
        port = flags.pop("port", None) or free_port(s.host)
        address = f"{s.host}:{port}"
        child = Child(name, serve_argv(service, {"host": s.host, "port": port, **flags}), self.log_dir / f"{name}.log")
        self.children.append(child)
        self.addresses[name] = address
        return address

    def _wait(self, addresses: list[str]) -> None:
        for child, address in zip(self.children[-len(addresses):], addresses):
            try:
                wait_serving(address, self.spec.start_timeout_s, alive=lambda c=child: c.poll() is None)
            except (ChildExited, TimeoutError) as exc:
                raise MeshFailed(f"{child.name} did not start ({exc}); last log lines:\n{child.log_tail()}") from exc

    def start(self) -> tuple[str, str]:
        """Starts every service; returns (router, control) addresses. On failure stops what started."""
        s = self.spec
        try:
            self.control_addr = self._spawn("control", "control", {"model_dir": s.model_dir, "expected_expert_servers": s.expert_servers})
            self._wait([self.control_addr])
            experts = [
                self._spawn(f"expert-{i}", "expert", {
                    "model_dir": s.model_dir, "control_addr": self.control_addr,
                    "experts_dtype": s.experts_dtype, "transport": "grpc" if s.transport == "grpc" else "auto",
                    "num_threads": s.threads_per_process(),
                })
                for i in range(s.expert_servers)
            ]
            self._wait(experts)
            attention = [
                self._spawn(f"attention-{i}", "attention", {
                    "model_dir": s.model_dir, "control_addr": self.control_addr, "transport": s.transport,
                    "num_threads": s.attention_threads or s.threads_per_process(),
                    "max_num_batched_tokens": s.max_num_batched_tokens or None,
                    # the replicas cache prefixes by default: the flag is passed only to turn it off
                    "prefix_cache": None if s.prefix_cache else False,
                })
                for i in range(s.attention_replicas)
            ]
            self._wait(attention)
            self.router_addr = self._spawn("router", "router", {
                "port": s.port or None, "attention": ",".join(attention), "model_dir": s.model_dir,
            })
            self._wait([self.router_addr])
            if s.http_port is not None:
                self._start_gateway()
        except BaseException:
            self.stop()
            raise
        return self.router_addr, self.control_addr

    def _start_gateway(self) -> None:
        """The HTTP gateway in front of the router; waits until its /health answers 200. The API key
        travels in the environment (MOEMESH_API_KEY), not on the command line."""
        s = self.spec
        port = s.http_port or free_port(s.host)
        flags = {"host": s.host, "port": port, "router": self.router_addr, "control": self.control_addr}
        env = {**os.environ, "MOEMESH_API_KEY": s.api_key} if s.api_key else None
        child = Child("gateway", serve_argv("gateway", flags), self.log_dir / "gateway.log", env=env)
        self.children.append(child)
        self.http_addr = f"{s.host}:{port}"
        self.addresses["gateway"] = self.http_addr
        try:
            wait_http_ok(f"http://{self.http_addr}/health", s.start_timeout_s, alive=lambda: child.poll() is None)
        except (ChildExited, TimeoutError) as exc:
            raise MeshFailed(f"gateway did not start ({exc}); last log lines:\n{child.log_tail()}") from exc

    def exited(self) -> Child | None:
        """The first child that has exited, if any."""
        return next((c for c in self.children if c.poll() is not None), None)

    def watch(self, stop: threading.Event, poll_s: float = 0.2) -> Child | None:
        """Blocks until `stop` is set (returns None) or a child exits (returns it)."""
        while not stop.wait(poll_s):
            dead = self.exited()
            if dead is not None:
                return dead
        return None

    def stop(self) -> None:
        """Router first (its streams drain), then the rest; no child outlives this call."""
        stop_all(list(reversed(self.children)), self.spec.grace_s)
