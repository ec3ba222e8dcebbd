"""A live mesh for the switching tests: real processes on loopback (control, expert servers,
attention, router), steered through `moemesh ctl`, with a bounded streaming workload."""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from moemesh.launcher.child import Child, stop_all
from moemesh.launcher.health import wait_serving
from moemesh.rpc.generation import build_request
from tests.fixtures.auth import TEST_RPC, token_env
from tests.fixtures.services import gen_grpc, start_service


def ctl(control: str, *args: str) -> dict:
    """`moemesh ctl --addr CONTROL --json ARGS` in this process; returns its JSON object."""
    from moemesh.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["ctl", "--addr", control, "--json", "--timeout", "120", *args])
    assert rc == 0, out.getvalue()
    return json.loads(out.getvalue())


class LiveMesh:
    def __init__(self, model_dir: Path, log_dir: Path, control_flags: dict, expert_flags: dict | None = None,
                 attention_flags: dict | None = None, router_flags: dict | None = None) -> None:
        self.model_dir = str(model_dir)
        self.log_dir = log_dir
        self.expert_flags = dict(expert_flags or {})
        self.children: dict[str, Child] = {}
        self.control = self._start("control", "control", {"model_dir": self.model_dir, **control_flags})
        self.experts: dict[str, str] = {}
        for _ in range(int(control_flags.get("expected_expert_servers", 1))):
            self.add_expert()
        self.attention = self._start("attention", "attention", {
            "model_dir": self.model_dir, "control_addr": self.control, "transport": "grpc", "num_threads": 1, **(attention_flags or {})})
        self.router = self._start("router", "router", {"model_dir": self.model_dir, "attention": self.attention, **(router_flags or {})})

    def _start(self, name: str, service: str, flags: dict) -> str:
        child, address = start_service(service, self.log_dir, name=name, **flags)
        self.children[name] = child
        return address

    def add_expert(self) -> str:
        """Starts one more expert server registered with the control plane; returns its child name."""
        name = f"expert-proc-{len(self.experts)}"
        self.experts[name] = self._start(name, "expert", {
            "model_dir": self.model_dir, "control_addr": self.control, "transport": "grpc", **self.expert_flags})
        return name

    def join_expert(self, timeout_s: float = 60) -> str:
        """Starts one more expert server and waits until the placement uses it; returns its server id."""
        sid = self.server_id(self.add_expert())
        self.wait_for(lambda st: sid in placement_servers(st), timeout_s, f"{sid} in the placement")
        return sid

    def server_id(self, name: str) -> str:
        """The control plane's id of the expert server child `name` (matched by address)."""
        for s in ctl(self.control, "status")["servers"]:
            if s["server"]["address"] == self.experts[name]:
                return s["server"]["server_id"]
        raise KeyError(f"{name} ({self.experts[name]}) is not registered")

    def metrics(self, name: str) -> str:
        """The /metrics text of child `name` (started with metrics_port 0: its ready line names the port)."""
        import re
        import urllib.request

        deadline = time.monotonic() + 10
        while not (m := re.search(r"serving \S+ .*metrics=(\S+)", self.children[name].log_path.read_text(errors="replace"))):
            assert time.monotonic() < deadline, f"{name} printed no metrics address"
            time.sleep(0.1)
        return urllib.request.urlopen(f"http://{m.group(1)}/metrics", timeout=10).read().decode()

    def kill(self, name: str) -> None:
        """SIGKILL an expert server child."""
        os.kill(self.children[name].proc.pid, signal.SIGKILL)
        self.children[name].proc.wait(10)

    def restart(self, name: str, address: str, timeout_s: float = 120) -> None:
        """SIGKILL child `name` and start it again with the same command line (same port, nothing
        of its state kept); returns once it serves at `address` again."""
        old = self.children[name]
        self.kill(name)
        old.close()
        child = Child(name, old.argv, old.log_path, env=token_env())
        self.children[name] = child
        wait_serving(address, timeout_s, alive=lambda: child.poll() is None, rpc=TEST_RPC)

    def signal(self, name: str, sig: int) -> None:
        """Send `sig` (e.g. SIGSTOP, SIGCONT) to child `name`."""
        os.kill(self.children[name].proc.pid, sig)

    def terminate(self, name: str, timeout_s: float = 60) -> int:
        """SIGTERM a child (it drains, then exits); returns its exit status."""
        os.kill(self.children[name].proc.pid, signal.SIGTERM)
        return self.children[name].proc.wait(timeout_s)

    def status(self) -> dict:
        return ctl(self.control, "status")

    def wait_for(self, predicate, timeout_s: float, what: str) -> dict:
        """Polls `status` until predicate(status) holds; returns it (AssertionError after timeout_s)."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.status()
            if predicate(st):
                return st
            assert time.monotonic() < deadline, f"{what} within {timeout_s}s; last status: {st}"
            time.sleep(0.2)

    def stop(self) -> None:
        stop_all(list(reversed(list(self.children.values()))), 5)


def placement_servers(st: dict) -> set[str]:
    return {s for layer in st["placement"].get("layers", []) for e in layer["experts"] for s in e["server_ids"]}


@dataclass
class Workload:
    """Greedy streams of `prompts` through the router, `concurrency` at a time, until stopped or
    `max_requests` were sent; records each request's tokens or error."""

    router: str
    prompts: list[list[int]]
    max_new_tokens: int = 8
    concurrency: int = 4
    max_requests: int = 400
    timeout_s: float = 120.0
    results: list[tuple[int, list[int]]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    longest_wait_s: float = 0.0  # the longest a stream waited for its next message (or its first)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _sent: int = 0

    def start(self) -> "Workload":
        for _ in range(self.concurrency):
            t = threading.Thread(target=self._worker, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _next(self) -> int | None:
        with self._lock:
            if self._stop.is_set() or self._sent >= self.max_requests:
                return None
            self._sent += 1
            return self._sent - 1

    def _worker(self) -> None:
        with grpc.insecure_channel(self.router) as ch:
            stub = gen_grpc.GenerationStub(ch)
            while (n := self._next()) is not None:
                i = n % len(self.prompts)
                req = build_request(prompt_token_ids=self.prompts[i], max_new_tokens=self.max_new_tokens, temperature=0.0,
                                    prompt_logprobs=False)
                try:
                    tokens, waited, last = [], 0.0, time.monotonic()
                    for r in stub.Generate(req, timeout=self.timeout_s):
                        now = time.monotonic()
                        waited, last = max(waited, now - last), now
                        tokens.extend(r.token_ids)
                    with self._lock:
                        self.results.append((i, tokens))
                        self.longest_wait_s = max(self.longest_wait_s, waited)
                except grpc.RpcError as e:
                    with self._lock:
                        self.errors.append(f"{e.code().name}: {e.details()}")

    def completed(self) -> int:
        with self._lock:
            return len(self.results) + len(self.errors)

    def wait_completed(self, n: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.completed() < n:
            assert time.monotonic() < deadline, f"only {self.completed()} of {n} requests completed within {timeout_s}s"
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 10)
