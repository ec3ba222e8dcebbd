"""One expert server's CPU per call under a CPU quota, by the quota's period.

    python bench/quota_call_cpu.py [--shape qwen3-sparse-tiny-skew] [--model DIR] [--cores 0.1]
        [--periods-ms 10,20,50,100] [--experts-per-call 4] [--rounds 2] [--phase-s 5] [--json]

One expert server (every expert of the checkpoint loaded, one torch thread) runs in a cgroup of its
own with a quota of `--cores` CPUs (`moemesh.launcher.cpu_budget`; cgroup v1 or v2 only: the quota's
period is what is measured; the quota is lifted while the server loads). A client in this process
sends it a decode-sized call (8 tokens, each routed to 2 of `--experts-per-call` experts of the first
MoE layer: 16 rows whatever the experts, so only the expert weights a call reads change) one at a
time, as fast as it answers, for `--phase-s` seconds at each (period, experts per call) in turn
(`--rounds` times, alternating), then once per experts-per-call without a quota. Each phase reports calls
per second and, from the server's window work (ExpertStats.window_work), its process CPU per call
and the thread CPU per call inside the kernel and in the servicer's handling outside it; and the
cgroup's throttled time per second, and the server process's CPU per call by thread name (from
/proc: the event loop's thread is "python", gRPC's are "event_engine" and "grpc_global_tim"). The budget (CPUs) is the same at every period: only the length
of the slices the server runs in changes (quota = cores x period). With `--json`, one JSON object is
printed last: {"phases": [{"phase", "period_ms", "experts", "calls_per_s", "cpu_per_call_ms", "kernel_ms",
"servicer_ms", "throttled_ms_per_s", "threads_ms": {name: ms}}, ...], "config": {...}}.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # as a script: the repository root instead of bench/ on sys.path
    _root = Path(__file__).resolve().parent.parent
    sys.path[:] = [str(_root)] + [p for p in sys.path if Path(p or ".").resolve() != _root / "bench"]

import torch

from bench.args import positive_ints
from bench.shapes import SHAPES, checkpoint_dir
from moemesh.launcher.child import Child, stop_all
from moemesh.launcher.cpu_budget import CpuBudgets
from moemesh.launcher.health import wait_serving
from moemesh.launcher.mesh import serve_argv
from moemesh.launcher.ports import free_port
from moemesh.models.registry import load_model_config
from moemesh.rpc.config import RpcConfig
from moemesh.rpc.protos import load
from moemesh.rpc.security import SecurityConfig
from moemesh.rpc.server import make_channel
from moemesh.transport.base import ExpertRequest
from moemesh.transport.grpc_transport import request_message

expert_pb2, expert_grpc = load("expert")
TOKEN = secrets.token_urlsafe(32)  # the mesh token of the server this benchmark starts (one per run)
RPC = RpcConfig(security=SecurityConfig(mesh_token=TOKEN))
WORK = ("requests", "cpu_seconds", "compute_cpu_seconds", "call_cpu_seconds")



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-sparse-tiny-skew", help="named checkpoint (bench/shapes.py)")
    p.add_argument("--model", default=None, help="a checkpoint directory instead of --shape")
    p.add_argument("--cores", type=float, default=0.1, help="the server's CPU budget")
    p.add_argument("--periods-ms", type=positive_ints, default=(10, 20, 50, 100), help="quota periods to compare")
    p.add_argument("--experts-per-call", type=positive_ints, default=(4,), help="experts each call's 16 rows go to (a list: each in turn)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--phase-s", type=float, default=5.0)
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure last")
    ns = p.parse_args(argv)
    if not 0 < ns.cores < 1 or ns.rounds < 1 or ns.phase_s <= 0:
        p.error("need 0 < --cores < 1, --rounds >= 1 and --phase-s > 0")
    if not 2 <= min(ns.experts_per_call) <= max(ns.experts_per_call) <= 16:
        p.error("need 2 <= --experts-per-call <= 16")
    if min(ns.periods_ms) * ns.cores < 1:
        p.error("each period x --cores must be at least 1 ms (the kernel's shortest quota)")
    return ns


def decode_call(model, experts: int) -> ExpertRequest:
    """8 tokens, each routed to 2 of `experts` experts of the first MoE layer (spread over its
    experts; each gets at least one row), bfloat16."""
    if not 2 <= experts <= min(16, model.num_experts):
        raise ValueError(f"experts_per_call must be in [2, {min(16, model.num_experts)}], got {experts}")
    g = torch.Generator().manual_seed(0)
    t = 8
    ids = [e * model.num_experts // experts for e in range(experts)]
    slots = torch.arange(2 * t) % experts  # [2T]: every expert gets a row, then round robin
    slots = slots[torch.randperm(2 * t, generator=g)].view(t, 2)  # [T, 2]
    slots[:, 1] = torch.where(slots[:, 1] == slots[:, 0], (slots[:, 1] + 1) % experts, slots[:, 1])  # two different experts a token
    rows = [torch.nonzero((slots == j).any(1)).flatten() for j in range(experts)]
    token_idx = torch.cat(rows).to(torch.int32)
    return ExpertRequest(model.moe_layers[0], 1, torch.randn(t, model.hidden_size, generator=g).to(torch.bfloat16), token_idx,
                         torch.rand(token_idx.numel(), generator=g), torch.tensor(ids), torch.tensor([r.numel() for r in rows]))


class Quota:
    """The cgroup's quota, set live (v1 `cpu.cfs_period_us` / `cpu.cfs_quota_us`, v2 `cpu.max`), and
    its throttled time."""

    def __init__(self, path: Path, mode: str) -> None:
        self.path, self.v2 = path, mode == "cgroup-v2"

    def set(self, cores: float | None, period_us: int = 100_000) -> None:
        if self.v2:
            (self.path / "cpu.max").write_text("max\n" if cores is None else f"{round(cores * period_us)} {period_us}\n")
            return
        (self.path / "cpu.cfs_quota_us").write_text("-1\n")  # lift it first: a new period is checked against the old quota
        if cores is not None:
            (self.path / "cpu.cfs_period_us").write_text(f"{period_us}\n")
            (self.path / "cpu.cfs_quota_us").write_text(f"{round(cores * period_us)}\n")

    def throttled_s(self) -> float:
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        return int(stat["throttled_usec"]) / 1e6 if "throttled_usec" in stat else int(stat.get("throttled_time", 0)) / 1e9


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of process `pid` so far, summed by thread name (/proc; threads that
    exited are not counted)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(rest[11]) + int(rest[12])) / tick  # utime, stime
    return out


async def measure(address: str, requests: dict, quota: Quota, phases, phase_s: float, pid: int) -> list[dict]:
    """Each (name, cores, period_us, experts) of `phases` in turn: closed-loop calls of
    `requests[experts]` for `phase_s` seconds."""
    request = next(iter(requests.values()))
    async with make_channel(address, RPC) as ch:
        stub = expert_grpc.ExpertServiceStub(ch)
        go: asyncio.Queue = asyncio.Queue()

        async def calls():
            call_id = 0
            while await go.get():
                call_id += 1
                request.call_id = call_id
                yield request

        answers = stub.ForwardStream(calls()).__aiter__()

        async def run(seconds: float) -> int:
            n, end = 0, time.monotonic() + seconds
            while time.monotonic() < end:
                await go.put(True)
                answer = await answers.__anext__()
                if answer.error_code:
                    raise RuntimeError(f"the server answered an error: {answer.error}")
                n += 1
            return n

        async def work() -> dict[str, float]:
            w = (await stub.GetStats(expert_pb2.GetStatsRequest(), timeout=30)).window_work
            return {k: getattr(w, k) for k in WORK}

        quota.set(None)
        for request in requests.values():  # warm (the loop below sends `request`)
            await run(1.0)
        out = []
        for name, cores, period_us, experts in phases:
            request = requests[experts]
            quota.set(cores, period_us)
            w0, th0, cpu0, t0 = await work(), quota.throttled_s(), thread_cpu(pid), time.monotonic()
            n = await run(phase_s)
            dt = time.monotonic() - t0
            w1, th1, cpu1 = await work(), quota.throttled_s(), thread_cpu(pid)
            d = {k: w1[k] - w0[k] for k in WORK}
            per = 1e3 / max(1, d["requests"])
            out.append({"phase": name, "period_ms": period_us / 1e3 if cores else None, "experts": experts, "calls_per_s": round(n / dt, 1),
                        "cpu_per_call_ms": round(d["cpu_seconds"] * per, 3), "kernel_ms": round(d["compute_cpu_seconds"] * per, 3),
                        "servicer_ms": round(d["call_cpu_seconds"] * per, 3), "throttled_ms_per_s": round(1e3 * (th1 - th0) / dt, 1),
                        "threads_ms": {k: round((v - cpu0.get(k, 0.0)) * per, 3) for k, v in sorted(cpu1.items()) if v > cpu0.get(k, 0.0)}})
        await go.put(False)
        return out


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if ns.json else print
    model_dir = ns.model or str(checkpoint_dir(ns.shape, progress=lambda msg: print(msg, file=sys.stderr, flush=True)))
    model = load_model_config(model_dir)
    budgets = CpuBudgets.detect()
    if budgets.mode not in ("cgroup-v1", "cgroup-v2"):
        print(f"bench/quota_call_cpu: needs a cgroup CPU quota: {budgets.describe()}", file=sys.stderr)
        return 2
    slot = budgets.slot("quota-probe", ns.cores)
    port = free_port()
    argv_ = serve_argv("expert", {"host": "127.0.0.1", "port": port, "model_dir": model_dir, "preload": "all", "transport": "grpc",
                                  "num_threads": 1, "load_window_s": 3600})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MOEMESH_MESH_TOKEN": TOKEN}
    log_dir = Path(tempfile.mkdtemp(prefix="moemesh-bench-quota-"))
    quota = Quota(slot.path, budgets.mode)
    quota.set(None)  # the server loads its experts at full speed; each phase sets the quota it measures
    child = Child("expert", slot.wrap(argv_), log_dir / "expert.log", env=env)
    load_before = os.getloadavg()[0]
    phases = [(f"{p} ms", ns.cores, p * 1000, k) for _ in range(ns.rounds) for p in ns.periods_ms for k in ns.experts_per_call]
    phases += [("no quota", None, 100_000, k) for k in ns.experts_per_call]
    try:
        wait_serving(f"127.0.0.1:{port}", 600, alive=lambda: child.poll() is None, rpc=RPC)
        requests = {k: request_message(decode_call(model, k)) for k in ns.experts_per_call}
        results = asyncio.run(measure(f"127.0.0.1:{port}", requests, quota, phases, ns.phase_s, child.proc.pid))
    finally:
        stop_all([child], 10)
        budgets.close()
    say(f"bench/quota_call_cpu: {model_dir}, one expert server at {ns.cores:g} cores ({budgets.mode}), closed-loop decode calls "
        f"(CPU, {os.cpu_count()} cores, load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end)")
    say(f"{'period':<10} {'experts':>7} {'calls/s':>8} {'cpu/call ms':>12} {'kernel ms':>10} {'servicer ms':>12} {'throttled ms/s':>15}   CPU ms per call by thread")
    for r in results:
        say(f"{r['phase']:<10} {r['experts']:7d} {r['calls_per_s']:8.1f} {r['cpu_per_call_ms']:12.3f} {r['kernel_ms']:10.3f} "
            f"{r['servicer_ms']:12.3f} {r['throttled_ms_per_s']:15.1f}   "
            + " ".join(f"{k} {v:.2f}" for k, v in r["threads_ms"].items()))
    if ns.json:
        print(json.dumps({"phases": results, "config": {"model": model_dir, "cores": ns.cores, "cpu_budget": budgets.mode,
                                                        "phase_s": ns.phase_s, "load_average": round(os.getloadavg()[0], 2),
                                                        "cpus": os.cpu_count()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
