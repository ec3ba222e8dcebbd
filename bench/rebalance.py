"""Rebalancing that pays, measured side by side in one run, and a live top-k switch.

    python bench/rebalance.py [--shape qwen3-sparse-skew] [--model DIR] [--expert-servers 4]
        [--expert-cpu-quota 0.1] [--expert-cpu-period-ms MS] [--top-k 2] [--redundant-experts 8] [--concurrency 8] [--output-len 32]
        [--warmup-s 10] [--phase-s 20] [--top-k-phases 8,4,8] [--json]

The mesh (control, expert servers, one attention replica, a router) runs as processes on this
machine; each expert server under its own CPU budget (`--expert-cpu-quota` cores:
`moemesh.launcher.cpu_budget`, a cgroup with a CPU quota, else pinned cores, else none, as printed),
as on separate GPUs or nodes, so a server holding hot experts is the step's bottleneck.

The checkpoint (bench/shapes.py) is `qwen3-sparse-skew` by default: 64 experts whose router favours a
few, Zipf-like, the favoured ones all starting on the first expert server (round robin over 4). `demo`
(the demo model, whose zero gate sends every token to experts 0..k-1 below top-k 8) works too.

Phases, with greedy streams flowing throughout (closed loop, `--concurrency` at a time):
  rebalance  at `--top-k`: `--warmup-s` unmeasured, `before` (`--phase-s`), `Rebalance` (the control
             plane solves, prices the candidates with its cost model and switches when it pays),
             `during` (until the attention replica runs the new version), `after` (`--phase-s`);
  top-k      `ctl set --top-k K` for each K of `--top-k-phases` in turn, `--phase-s` each: each
             switch's throughput change against what the cost model predicted for it (a top-k
             change scales the traffic to the experts by new / old).
Requests failed over all phases must be 0. With `--json`, one JSON object is printed last:
{"before": {"tokens_per_s", "tpot_p50_ms", "tpot_p99_ms", ...}, "during": {...}, "after": {...},
 "failed", "balancedness_before", "balancedness_after", "predicted_gain", "measured_gain",
 "top_k_switch": [{"top_k", "tokens_per_s", ..., "predicted_gain", "measured_gain"}, ...], ...}.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # as a script: the repository root instead of bench/ on sys.path
    _root = Path(__file__).resolve().parent.parent
    sys.path[:] = [str(_root)] + [p for p in sys.path if Path(p or ".").resolve() != _root / "bench"]

import grpc

from bench.args import positive_ints_or_none
from bench.shapes import SHAPES, checkpoint_dir
from moemesh.contracts.wire import control_grpc, control_pb2
from moemesh.launcher.child import Child, stop_all
from moemesh.launcher.cpu_budget import CpuBudgets
from moemesh.launcher.health import wait_serving
from moemesh.launcher.mesh import serve_argv
from moemesh.launcher.ports import free_port
from moemesh.rpc.config import RpcConfig
from moemesh.rpc.generation import build_request
from moemesh.rpc.protos import load
from moemesh.rpc.security import SecurityConfig
from moemesh.rpc.server import make_sync_channel

gen_pb, gen_grpc = load("generation")
PROMPTS = [
    "What is the capital of France?", "Name three colours of the rainbow.", "Why is the sky blue?",
    "Write a haiku about the sea.", "What is two plus two?", "Describe a cat in one sentence.",
    "List four planets.", "How do bees make honey?",
]
BENCH_TOKEN = secrets.token_urlsafe(32)  # the mesh token of the services this benchmark starts (one per run)
BENCH_RPC = RpcConfig(security=SecurityConfig(mesh_token=BENCH_TOKEN))



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-sparse-skew", help="named checkpoint (bench/shapes.py)")
    p.add_argument("--model", default=None, help="a checkpoint directory instead of --shape")
    p.add_argument("--expert-servers", type=int, default=4)
    p.add_argument("--expert-cpu-quota", type=float, default=0.1, metavar="CORES",
                   help="CPUs each expert server may use (its own cgroup or cores); 0 = no budget. The default "
                        "makes the expert servers, not the attention replica, bound the step on a 2-core machine")
    p.add_argument("--expert-cpu-period-ms", type=float, default=None, metavar="MS",
                   help="the period of each expert server's CPU quota (cgroup modes; default: the launcher's, "
                        "lengthened so the quota is at least 1 ms: 10 ms at 0.1 cores). Longer periods cost a call less CPU "
                        "(bench/quota_call_cpu.py) but let a server run in longer bursts between stalls")
    p.add_argument("--top-k", type=int, default=2, help="routing top-k of the rebalance phases")
    p.add_argument("--redundant-experts", type=int, default=8, help="extra expert copies per layer the rebalance may place")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--warmup-s", type=float, default=10.0, help="seconds of streaming before the measured phases")
    p.add_argument("--phase-s", type=float, default=20.0, help="seconds of each measured phase (and the servers' load window)")
    p.add_argument("--top-k-phases", type=positive_ints_or_none, default=(8, 4, 8), help="top-k of each phase after the rebalance ('' = none)")
    p.add_argument("--attention-threads", type=int, default=1, help="torch threads of the attention replica")
    p.add_argument("--transport", choices=("grpc", "dist"), default="grpc", help="attention <-> expert transport")
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure last")
    ns = p.parse_args(argv)
    if ns.expert_servers < 1 or ns.concurrency < 1 or ns.output_len < 2 or ns.top_k < 1 or ns.attention_threads < 1:
        p.error("need --expert-servers, --concurrency, --top-k and --attention-threads >= 1 and --output-len >= 2")
    if ns.phase_s <= 0 or ns.warmup_s < 0 or ns.expert_cpu_quota < 0 or ns.redundant_experts < 0:
        p.error("need --phase-s > 0 and --warmup-s, --expert-cpu-quota, --redundant-experts >= 0")
    if ns.expert_cpu_period_ms is not None and not 1 <= ns.expert_cpu_period_ms <= 1000:
        p.error("need 1 <= --expert-cpu-period-ms <= 1000 (the periods the kernel takes)")
    return ns


def start(children: list[Child], log_dir: Path, name: str, service: str, flags: dict, timeout_s: float, threads: int,
          wrap=list) -> str:
    """One service process with `threads` torch/OpenMP threads (more than its cores spin-wait)."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "MOEMESH_MESH_TOKEN": BENCH_TOKEN}
    child = Child(name, wrap(serve_argv(service, {"host": "127.0.0.1", "port": port, **flags})), log_dir / f"{name}.log", env=env)
    children.append(child)
    address = f"127.0.0.1:{port}"
    wait_serving(address, timeout_s, alive=lambda: child.poll() is None, rpc=BENCH_RPC)
    return address


class Streams:
    """Closed-loop greedy streams; records (arrival time, gap since the previous token) per token."""

    def __init__(self, router: str, concurrency: int, output_len: int) -> None:
        self.router, self.output_len = router, output_len
        self.tokens: list[tuple[float, float | None]] = []
        self.done: list[float] = []
        self.failed: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(concurrency)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _worker(self, i: int) -> None:
        with grpc.insecure_channel(self.router) as ch:
            stub = gen_grpc.GenerationStub(ch)
            n = i
            while not self._stop.is_set():
                req = build_request(prompt=PROMPTS[n % len(PROMPTS)], max_new_tokens=self.output_len, temperature=0.0, ignore_eos=True)
                n += len(self._threads)
                last = None
                try:
                    for resp in stub.Generate(req, timeout=300):
                        now = time.monotonic()
                        with self._lock:
                            for _ in resp.token_ids:
                                self.tokens.append((now, None if last is None else now - last))
                                last = now
                    with self._lock:
                        self.done.append(time.monotonic())
                except grpc.RpcError as e:
                    with self._lock:
                        self.failed.append(f"{e.code().name}: {e.details()}")

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(310)


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    tokens_per_s: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    completed: int

    @classmethod
    def measure(cls, name: str, streams: Streams, t0: float, t1: float) -> "Phase":
        with streams._lock:
            toks = [(t, gap) for t, gap in streams.tokens if t0 <= t < t1]
            done = sum(1 for t in streams.done if t0 <= t < t1)
        gaps = [g for _, g in toks if g is not None]
        secs = max(t1 - t0, 1e-9)
        return cls(name, secs, len(toks) / secs, 1e3 * percentile(gaps, 0.5), 1e3 * percentile(gaps, 0.99), done)

    def row(self) -> str:
        return (f"{self.name:<10} {self.seconds:7.1f} {self.tokens_per_s:10.2f} {self.tpot_p50_ms:9.1f} {self.tpot_p99_ms:9.1f} "
                f"{self.completed:9d}")

    def figures(self) -> dict:
        return {"seconds": round(self.seconds, 2), "tokens_per_s": round(self.tokens_per_s, 3), "tpot_p50_ms": round(self.tpot_p50_ms, 2),
                "tpot_p99_ms": round(self.tpot_p99_ms, 2), "completed": self.completed}


def busy(a, b, seconds: float) -> str:
    """Each expert server's compute seconds between two GetStatus answers, per second."""
    was = {s.server.server_id: s.busy_seconds for s in a.servers}
    return " ".join(f"{s.server.server_id}={(s.busy_seconds - was.get(s.server.server_id, 0.0)) / seconds:.2f}" for s in b.servers)


def server_shares(st) -> str:
    """Each expert server's share of the window load (tokens it computed)."""
    total = sum(s.window_tokens for s in st.servers) or 1
    return " ".join(f"{s.server.server_id}={s.window_tokens / total:.2f}" for s in st.servers)


def window_work(st) -> str:
    """Each expert server's work over its load window, per second: calls, rows, CPU (of its limit),
    computing, in service; and its CPU per call: all of it, in the kernel, and in the servicer's
    handling outside it (the rest: gRPC threads, the event loop, heartbeats)."""
    out = []
    for s in st.servers:
        w = s.window_work
        if w.seconds <= 0:
            continue
        limit = f"/{w.cpu_limit:g}" if w.cpu_limit else ""
        out.append(f"{s.server.server_id}: {w.requests / w.seconds:.0f} calls/s, {w.rows / w.seconds:.0f} rows/s, "
                   f"{w.expert_calls / max(1, w.requests):.1f} experts/call, "
                   f"cpu {w.cpu_seconds / w.seconds:.2f}{limit}, computing {w.busy_seconds / w.seconds:.2f}, "
                   f"in service {w.service_seconds / w.seconds:.2f}, "
                   f"cpu per call {_ms_per(w.cpu_seconds, w.requests)} ms (kernel {_ms_per(w.compute_cpu_seconds, w.requests)}, "
                   f"servicer {_ms_per(w.call_cpu_seconds, w.requests)})")
    return "; ".join(out)


def _ms_per(seconds: float, count: int) -> str:
    return f"{1e3 * seconds / count:.2f}" if count else "-"


def rebalance_watching(ctl, version: int):
    """Rebalance (which returns once the old copies are dropped), watching meanwhile for the moment
    every attention replica runs a version after `version`: (the answer, that moment or None)."""
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(ctl.Rebalance, control_pb2.RebalanceRequest(), timeout=600)
        adopted = None
        while not call.done():
            st = ctl.GetStatus(control_pb2.GetStatusRequest(), timeout=30)
            if adopted is None and st.replicas and all(r.adopted_version > version for r in st.replicas):
                adopted = time.monotonic()
            time.sleep(0.05)
        return call.result(), adopted


def wait_adopted(ctl, version: int) -> None:
    """Until the attention replica runs `version` and no switch is in flight."""
    while True:
        st = ctl.GetStatus(control_pb2.GetStatusRequest(), timeout=30)
        if all(r.adopted_version >= version for r in st.replicas) and not st.switching:
            return
        time.sleep(0.05)


def run(ns: argparse.Namespace, model: str, log_dir: Path, budgets: CpuBudgets | None, say) -> dict:
    children: list[Child] = []
    streams = None
    try:
        control = start(children, log_dir, "control", "control", {
            "model_dir": model, "expected_expert_servers": ns.expert_servers, "heartbeat_interval_s": 0.5,
            "redundant_experts": ns.redundant_experts, "rebalance_min_tokens": 1}, ns.start_timeout_s, 1)
        for i in range(ns.expert_servers):
            period = {} if ns.expert_cpu_period_ms is None else {"period_us": round(1000 * ns.expert_cpu_period_ms)}
            slot = budgets.slot(f"expert-{i}", ns.expert_cpu_quota, **period) if budgets else None
            threads = (slot.threads if slot else None) or 1
            if slot:
                say(f"  {slot.describe()}")
            start(children, log_dir, f"expert-{i}", "expert", {"model_dir": model, "control_addr": control,
                                                               "transport": "grpc" if ns.transport == "grpc" else "auto",
                                                               "load_window_s": ns.phase_s, "num_threads": threads},
                  ns.start_timeout_s, threads, wrap=slot.wrap if slot else list)
        attention = start(children, log_dir, "attention", "attention", {"model_dir": model, "control_addr": control,
                                                                         "num_threads": ns.attention_threads, "transport": ns.transport},
                          ns.start_timeout_s, ns.attention_threads)
        router = start(children, log_dir, "router", "router", {"model_dir": model, "attention": attention}, ns.start_timeout_s, 1)
        with make_sync_channel(control, BENCH_RPC) as ch:
            ctl = control_grpc.ControlServiceStub(ch)
            ctl.SetKnobs(control_pb2.SetKnobsRequest(top_k=ns.top_k), timeout=120)
            streams = Streams(router, ns.concurrency, ns.output_len)
            streams.start()
            time.sleep(ns.warmup_s)
            t_start = time.monotonic()
            start_st = ctl.GetStatus(control_pb2.GetStatusRequest(), timeout=30)
            time.sleep(ns.phase_s)
            before_st = ctl.GetStatus(control_pb2.GetStatusRequest(), timeout=30)
            t_switch = time.monotonic()
            resp, t_adopted = rebalance_watching(ctl, before_st.placement_version)
            wait_adopted(ctl, resp.placement_version)
            t_switched = time.monotonic()
            t_adopted = t_adopted or t_switched
            switched_st = ctl.GetStatus(control_pb2.GetStatusRequest(), timeout=30)
            time.sleep(ns.phase_s)
            t_end = time.monotonic()
            after_st = ctl.GetStatus(control_pb2.GetStatusRequest(), timeout=30)
            before, after = Phase.measure("before", streams, t_start, t_switch), Phase.measure("after", streams, t_switched, t_end)
            during = Phase.measure("during", streams, t_switch, t_switched)
            parts = (Phase.measure("  to adopt", streams, t_switch, t_adopted), Phase.measure("  release", streams, t_adopted, t_switched))
            knob_phases = []
            for k in ns.top_k_phases:
                knobs = ctl.SetKnobs(control_pb2.SetKnobsRequest(top_k=k), timeout=300)
                wait_adopted(ctl, knobs.placement_version)
                t0 = time.monotonic()
                time.sleep(ns.phase_s)
                phase = Phase.measure(f"top-k {k}", streams, t0, time.monotonic())
                knob_phases.append((k, knobs.predicted_gain, phase, ctl.GetStatus(control_pb2.GetStatusRequest(), timeout=30)))
        streams.stop()
        return {
            "phases": (before, during, after), "during_parts": parts, "rebalance": resp, "knob_phases": knob_phases, "failed": list(streams.failed),
            "status": (start_st, before_st, switched_st, after_st), "spans": (t_switch - t_start, t_end - t_switched),
        }
    finally:
        if streams is not None:
            streams.stop()
        stop_all(list(reversed(children)), 10)


def report(ns: argparse.Namespace, model: str, out: dict, budget_mode: str, load_before: float) -> dict:
    before, during, after = out["phases"]
    resp = out["rebalance"]
    start_st, before_st, switched_st, after_st = out["status"]
    span_before, span_after = out["spans"]
    measured = after.tokens_per_s / before.tokens_per_s if before.tokens_per_s else float("nan")
    print(f"bench/rebalance: {model}, {ns.expert_servers} expert servers at {ns.expert_cpu_quota:g} cores each ({budget_mode}), "
          f"top-k {ns.top_k}, {ns.concurrency} greedy streams x {ns.output_len} tokens, attention {ns.attention_threads} thread(s), "
          f"{ns.transport} transport "
          f"(CPU, {os.cpu_count()} cores, load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end)")
    print(f"{'phase':<10} {'seconds':>7} {'tokens/s':>10} {'tpot p50':>9} {'tpot p99':>9} {'completed':>9}   (tpot in ms)")
    for phase in (before, during, *out["during_parts"], after):
        print(phase.row())
    print(f"balancedness (window load, mean/max server load): {before_st.balancedness:.3f} on v{before_st.placement_version} -> "
          f"{after_st.balancedness:.3f} on v{after_st.placement_version} (switched={resp.switched}, {resp.moves} expert copies "
          f"loaded{', ' + resp.reason if resp.reason else ''})")
    print(f"server shares of the load: before {server_shares(before_st)}; after {server_shares(after_st)}")
    print(f"cost model: predicted step {resp.step_ms_before:.1f} ms -> {resp.step_ms_after:.1f} ms, gain {resp.predicted_gain:.2f}x "
          f"({'calibrated' if resp.calibrated else 'priors only'}{', bound by a CPU budget' if resp.budget_bound else ''}); switch {resp.bytes_to_load / 1e6:.0f} MB, predicted "
          f"{resp.switch_seconds:.2f} s of loading")
    print(f"gain: predicted {resp.predicted_gain:.2f}x, measured {measured:.2f}x tokens/s; TPOT p99 {after.tpot_p99_ms / before.tpot_p99_ms:.2f}x "
          f"of before; during the switch {during.tokens_per_s / before.tokens_per_s:.2f}x of before's tokens/s")
    print(f"expert servers' compute time per second: before {busy(start_st, before_st, span_before)}; "
          f"after {busy(switched_st, after_st, span_after)}")
    print(f"expert servers' window work per second, before: {window_work(before_st)}")
    print(f"  after: {window_work(after_st)}")
    knobs = []
    previous = after
    for k, predicted, phase, _ in out["knob_phases"]:
        gain = phase.tokens_per_s / previous.tokens_per_s if previous.tokens_per_s else float("nan")
        knobs.append({"top_k": k, **phase.figures(), "predicted_gain": round(predicted, 3), "measured_gain": round(gain, 3)})
        previous = phase
    if knobs:
        print("live top-k switch (each against the phase before it):")
        print(f"{'phase':<10} {'seconds':>7} {'tokens/s':>10} {'tpot p50':>9} {'tpot p99':>9} {'completed':>9} {'predicted':>9} {'measured':>9}")
        for entry, (_, _, phase, _) in zip(knobs, out["knob_phases"]):
            print(f"{phase.row()} {entry['predicted_gain']:8.2f}x {entry['measured_gain']:8.2f}x")
        for k, _, _, st in out["knob_phases"]:
            print(f"  window work per second at top-k {k}: {window_work(st)}")
    failed = out["failed"]
    print(f"requests failed: {len(failed)}" + (f" ({failed[:3]})" if failed else ""))
    return {
        "before": before.figures(), "during": during.figures(), "after": after.figures(), "failed": len(failed),
        "during_to_adopt": out["during_parts"][0].figures(), "during_release": out["during_parts"][1].figures(),
        "balancedness_before": round(before_st.balancedness, 4), "balancedness_after": round(after_st.balancedness, 4),
        "predicted_gain": round(resp.predicted_gain, 3), "measured_gain": round(measured, 3), "switched": resp.switched,
        "moves": resp.moves, "bytes_to_load": resp.bytes_to_load, "top_k_switch": knobs,
        "config": {"model": model, "expert_servers": ns.expert_servers, "expert_cpu_quota": ns.expert_cpu_quota,
                   "expert_cpu_period_ms": ns.expert_cpu_period_ms, "cpu_budget": budget_mode,
                   "top_k": ns.top_k, "concurrency": ns.concurrency, "transport": ns.transport, "output_len": ns.output_len, "phase_s": ns.phase_s,
                   "load_average": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()},
    }


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if ns.json else print
    model = ns.model or str(checkpoint_dir(ns.shape, progress=lambda msg: print(msg, file=sys.stderr, flush=True)))
    budgets = CpuBudgets.detect() if ns.expert_cpu_quota else None
    mode = budgets.mode if budgets else "no budget"
    if budgets:
        say(f"bench/rebalance: cpu budget per expert server: {budgets.describe()}")
    log_dir = Path(tempfile.mkdtemp(prefix="moemesh-bench-rebalance-"))
    load_before = os.getloadavg()[0]
    try:
        out = run(ns, model, log_dir, budgets, say)
    finally:
        if budgets:
            budgets.close()
    if ns.json:  # the table to stderr, the JSON object alone on stdout
        with contextlib.redirect_stdout(sys.stderr):
            figures = report(ns, model, out, mode, load_before)
        print(json.dumps(figures))
    else:
        report(ns, model, out, mode, load_before)
        print(f"logs in {log_dir}")
    return 0 if not out["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
