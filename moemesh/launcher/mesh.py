"""`Mesh`: the whole mesh on this machine as child processes.

    start:     control -> expert servers -> attention replicas -> router (-> HTTP gateway), each
               healthy before the next
    supervise: until asked to stop; a child that exits is started again on its port (backoff),
               and rejoins (an expert server registers again and gets experts, an attention replica
               registers and the router finds it at its address); one that keeps failing past
               `RestartPolicy` is reported failed while the rest go on serving
    stop:      SIGTERM all (router first, so streams drain), then SIGKILL what is left

CPU budgets: with `MeshSpec.expert_cpu_quota`, each expert server runs under a budget of its own
(`moemesh.launcher.cpu_budget`: a cgroup with a CPU quota, else pinned cores, else none, said so on
stderr) with as many torch threads as whole cores fit in it; the cgroups are removed at stop.

The mesh token: the one the environment gives (`MOEMESH_MESH_TOKEN`), else a new random one, is
written to `mesh-token` in the log directory (mode 0600) and every child gets that file's path
(`--mesh-token-file`), never the token itself on its command line. `moemesh ctl` takes the same file.
The API key (`MeshSpec.api_key`) guards both public doors, the router's gRPC API and the gateway's
HTTP APIs; children get it as MOEMESH_API_KEY in their environment.
"""
from __future__ import annotations

import os
import secrets
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kernels.prepare import DENSE_DTYPES, EXPERT_DTYPES, check_dense_dtype
from moemesh.rpc.config import RpcConfig
from moemesh.rpc.security import SecurityConfig

from moemesh.launcher.child import Child, stop_all
from moemesh.launcher.cpu_budget import CpuBudgets, check_cores
from moemesh.launcher.health import ChildExited, wait_http_ok, wait_serving
from moemesh.launcher.ports import free_port


TRANSPORTS = ("grpc", "dist", "auto")


@dataclass(frozen=True)
class MeshSpec:
    """The whole mesh on this machine. `moemesh up`, `demo` and `bench` derive their mesh flags from
    these fields (`moemesh/cli/up.py`, through `moemesh.svc_config`); a field without metadata is the
    launcher's own (no flag)."""

    model_dir: str = field(metadata={"help": "Hugging Face model directory; empty = the demo model (built once, then cached)", "metavar": "DIR"})
    expert_servers: int = field(default=2, metadata={"help": "expert server processes", "metavar": "N"})
    attention_replicas: int = field(default=1, metadata={"help": "attention replica processes", "metavar": "N"})
    experts_dtype: str | None = field(default=None, metadata={"help": "expert weight format; unset = as stored", "choices": EXPERT_DTYPES})
    dense_dtype: str | None = field(default=None, metadata={
        "help": "attention replicas hold the attention projections, dense MLPs and LM head in this format (fp8 = "
                "BlockwiseFP8 128x128); unset = the compute dtype", "choices": DENSE_DTYPES})
    transport: str = field(default="grpc", metadata={
        "help": "attention <-> expert transport (auto: torch.distributed on this node, gRPC across nodes)", "choices": TRANSPORTS})
    host: str = "127.0.0.1"
    port: int = field(default=0, metadata={"help": "the router's port (0 = any free port)", "metavar": "P"})
    start_timeout_s: float = field(default=600.0, metadata={"help": "how long each service may take to start", "metavar": "S"})
    grace_s: float = 10.0
    attention_threads: int = field(default=0, metadata={
        "help": "torch threads per attention replica (0 = this machine's cores split evenly over the compute processes)", "metavar": "N"})
    http_port: int | None = field(default=None, metadata={
        "help": "also start the HTTP gateway (OpenAI/Anthropic APIs, chat page) on this port (0 = any free port; unset = no gateway)",
        "metavar": "P"})
    prefix_cache: bool = field(default=True, metadata={
        "help": "attention replicas reuse the KV blocks of earlier prompts' shared prefixes"})
    max_num_batched_tokens: int = field(default=0, metadata={
        "help": "tokens per attention step: decodes first, then prompt chunks (0 = the replicas' default); smaller keeps "
                "streams flowing while long prompts prefill", "metavar": "N"})
    all_experts_path: bool = field(default=True, metadata={
        "help": "for a model whose top-k is its number of experts, expert servers run calls that send every token to "
                "every expert held as two matmuls over those experts side by side; off, every call runs kernels.moe_mlp"})
    api_key: str = field(default="", metadata={
        "help": "the public API key: clients of the router (`authorization: Bearer KEY`) and of the gateway "
                "(`Authorization: Bearer KEY` or `x-api-key: KEY`) must send it (empty = none)",
        "env": "MOEMESH_API_KEY", "metavar": "KEY"})
    tls_cert: str | None = field(default=None, metadata={
        "help": "with --tls-key and --tls-ca, mTLS between all services: the PEM certificate every service presents", "metavar": "FILE"})
    tls_key: str | None = field(default=None, metadata={"help": "the certificate's PEM private key (mTLS)", "metavar": "FILE"})
    tls_ca: str | None = field(default=None, metadata={"help": "the PEM CA the services' certificates chain to (mTLS)", "metavar": "FILE"})
    tls_server_name: str | None = field(default=None, metadata={
        "help": "the name the certificate carries when it is not the host dialed", "metavar": "NAME"})
    expert_cpu_quota: float = field(default=0.0, metadata={
        "help": "each expert server gets CORES CPUs of its own, as on separate machines: a cgroup with a CPU quota "
                "(cgroup v2 cpu.max or v1 cfs quota, needs write access to /sys/fs/cgroup), else pinned cores; "
                "its torch threads match (0 = no budget: every server may use every core)", "metavar": "CORES"})

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
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.experts_dtype is not None and self.experts_dtype not in EXPERT_DTYPES:
            raise ValueError(f"experts_dtype must be one of {EXPERT_DTYPES} (or unset), got {self.experts_dtype!r}")
        check_dense_dtype(self.dense_dtype)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.max_num_batched_tokens < 0:
            raise ValueError(f"max_num_batched_tokens must be >= 0 (0 = the replicas' default), got {self.max_num_batched_tokens}")
        if self.expert_cpu_quota:
            check_cores(self.expert_cpu_quota, "expert_cpu_quota")
        self.tls()  # validates the certificate files

    def tls(self) -> SecurityConfig:
        return SecurityConfig(tls_cert=self.tls_cert, tls_key=self.tls_key, tls_ca=self.tls_ca, tls_server_name=self.tls_server_name)


def write_token_file(directory: Path, token: str | None = None) -> Path:
    """`directory`/mesh-token holding `token` (a new random one when None), readable by its owner only."""
    path = directory / "mesh-token"
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write((token or secrets.token_urlsafe(32)) + "\n")
    return path


@dataclass(frozen=True)
class RestartPolicy:
    """How `Mesh.supervise` restarts a child that exited: after `backoff_initial_s`, doubling per
    exit within `window_s` up to `backoff_max_s`; more than `max_restarts` exits within `window_s`
    and the service is failed (not restarted again; the rest of the mesh keeps running)."""

    max_restarts: int = 5
    window_s: float = 300.0
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0

    def delay(self, recent_exits: int) -> float:
        return min(self.backoff_max_s, self.backoff_initial_s * 2 ** max(0, recent_exits - 1))


@dataclass
class _Restarts:
    exits: list[float] = field(default_factory=list)  # monotonic times of its exits
    due: float | None = None  # when it is started again (None: running)
    failed: bool = False


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
        self.token_file = write_token_file(self.log_dir, os.environ.get("MOEMESH_MESH_TOKEN") or None)
        tls = spec.tls()
        # what every child is started with, and how the launcher itself calls them
        self.rpc = RpcConfig(security=SecurityConfig(mesh_token_file=str(self.token_file), tls_cert=tls.tls_cert, tls_key=tls.tls_key,
                                                     tls_ca=tls.tls_ca, tls_server_name=tls.tls_server_name))
        self.security_flags = {"mesh_token_file": str(self.token_file), "tls_cert": tls.tls_cert, "tls_key": tls.tls_key,
                               "tls_ca": tls.tls_ca, "tls_server_name": tls.tls_server_name}
        # children read secrets from the environment, not their command line: the token from its file,
        # the API key as MOEMESH_API_KEY
        self.env = {k: v for k, v in os.environ.items() if k != "MOEMESH_MESH_TOKEN"}
        if spec.api_key:
            self.env["MOEMESH_API_KEY"] = spec.api_key
        self._argv: dict[str, list[str]] = {}  # child name -> its command line (a restart reuses it, port included)
        self._restarts: dict[str, _Restarts] = {}
        self.budgets: CpuBudgets | None = None  # the expert servers' CPU budgets (spec.expert_cpu_quota)

    def _spawn(self, name: str, service: str, flags: dict[str, object], wrap: Callable[[list[str]], list[str]] = list) -> str:
        s = self.spec
        port = flags.pop("port", None) or free_port(s.host)
        address = f"{s.host}:{port}"
        argv = wrap(serve_argv(service, {"host": s.host, "port": port, **flags, **self.security_flags}))
        child = Child(name, argv, self.log_dir / f"{name}.log", env=self.env)
        self._argv[name] = argv
        self.children.append(child)
        self.addresses[name] = address
        return address

    def _wait(self, addresses: list[str]) -> None:
        for child, address in zip(self.children[-len(addresses):], addresses):
            try:
                wait_serving(address, self.spec.start_timeout_s, alive=lambda c=child: c.poll() is None, rpc=self.rpc)
            except (ChildExited, TimeoutError) as exc:
                last = child.log_tail(1).strip() or "no output"
                raise MeshFailed(f"{child.name} did not start ({exc}): {last} (log: {child.log_path})") from exc

    def start(self, report: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> tuple[str, str]:
        """Starts every service; returns (router, control) addresses. On failure stops what started.
        `report` gets the CPU budget lines (with `expert_cpu_quota`)."""
        s = self.spec
        try:
            self.control_addr = self._spawn("control", "control", {"model_dir": s.model_dir, "expected_expert_servers": s.expert_servers})
            self._wait([self.control_addr])
            experts = [self._spawn_expert(i, report) for i in range(s.expert_servers)]
            self._wait(experts)
            attention = [
                self._spawn(f"attention-{i}", "attention", {
                    "model_dir": s.model_dir, "control_addr": self.control_addr, "transport": s.transport,
                    "dense_dtype": s.dense_dtype,
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

    def _spawn_expert(self, i: int, report: Callable[[str], None]) -> str:
        s = self.spec
        name = f"expert-{i}"
        flags = {
            "model_dir": s.model_dir, "control_addr": self.control_addr,
            "experts_dtype": s.experts_dtype, "transport": "grpc" if s.transport == "grpc" else "auto",
            "num_threads": s.threads_per_process(),
            "all_experts_path": None if s.all_experts_path else False,  # passed only to turn it off
        }
        if not s.expert_cpu_quota:
            return self._spawn(name, "expert", flags)
        if self.budgets is None:
            self.budgets = CpuBudgets.detect()
            report(f"moemesh up: cpu budget per expert server: {self.budgets.describe()}")
        slot = self.budgets.slot(name, s.expert_cpu_quota)
        report(f"moemesh up: {slot.describe()}")
        if self.budgets.mode == "affinity" and self.budgets.shared_cores():
            report(f"moemesh up: {name} shares its cores with another expert server (more budgets than cores)")
        flags["num_threads"] = slot.threads or flags["num_threads"]
        return self._spawn(name, "expert", flags, wrap=slot.wrap)

    def _start_gateway(self) -> None:
        """The HTTP gateway in front of the router; waits until its /health answers 200. The API key
        travels in the environment (MOEMESH_API_KEY), like every secret, not on the command line."""
        s = self.spec
        port = s.http_port or free_port(s.host)
        flags = {"host": s.host, "port": port, "router": self.router_addr, "control": self.control_addr, **self.security_flags}
        argv = serve_argv("gateway", flags)
        child = Child("gateway", argv, self.log_dir / "gateway.log", env=self.env)
        self._argv["gateway"] = argv
        self.children.append(child)
        self.http_addr = f"{s.host}:{port}"
        self.addresses["gateway"] = self.http_addr
        try:
            wait_http_ok(f"http://{self.http_addr}/health", s.start_timeout_s, alive=lambda: child.poll() is None)
        except (ChildExited, TimeoutError) as exc:
            last = child.log_tail(1).strip() or "no output"
            raise MeshFailed(f"gateway did not start ({exc}): {last} (log: {child.log_path})") from exc

    def supervise(self, stop: threading.Event, policy: RestartPolicy = RestartPolicy(), poll_s: float = 0.2,
                  report: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> list[str]:
        """Until `stop` is set: restart every child that exits (same command line and port, after
        the policy's backoff), report each exit, restart and failure with `report`. Returns the
        names of the services that failed for good."""
        while not stop.wait(poll_s):
            self.restart_exited(policy, report, time.monotonic())
        return sorted(name for name, r in self._restarts.items() if r.failed)

    def restart_exited(self, policy: RestartPolicy, report: Callable[[str], None], now: float) -> None:
        """One supervision pass: schedule the children that exited, start those that are due."""
        for i, child in enumerate(self.children):
            r = self._restarts.setdefault(child.name, _Restarts())
            if r.failed:
                continue
            if r.due is None:
                code = child.poll()
                if code is None:
                    continue
                r.exits = [t for t in r.exits if now - t < policy.window_s] + [now]
                if len(r.exits) > policy.max_restarts:
                    r.failed = True
                    report(f"moemesh up: error: {child.name} exited with {code} {len(r.exits)} times within {policy.window_s:.0f}s: "
                           f"not restarting it; the rest of the mesh keeps running. Last log lines:\n{child.log_tail()}")
                    continue
                r.due = now + policy.delay(len(r.exits))
                report(f"moemesh up: {child.name} exited with {code}; restarting it in {r.due - now:.1f}s")
            elif now >= r.due:
                child.close()
                self.children[i] = Child(child.name, self._argv[child.name], child.log_path, env=self.env)
                r.due = None
                report(f"moemesh up: restarted {child.name} (pid {self.children[i].pid})")

    def stop(self) -> None:
        """Router first (its streams drain), then the rest; no child outlives this call. Then the
        CPU budgets' cgroups go."""
        stop_all(list(reversed(self.children)), self.spec.grace_s)
        if self.budgets is not None:
            self.budgets.close()
