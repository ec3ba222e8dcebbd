"""Live rebalance under a skewed workload on the demo model: throughput and time per output token
before, during and after a rebalance, with the control plane's balancedness figure.

The demo model's gate is zero (every expert equally likely); with top-k lowered to 2 the tie
breaks to experts 0 and 1 for every token, a maximally skewed workload. The mesh (control, 3
expert servers, attention, router as processes on this machine) starts on the round-robin
placement, where each layer's two hot experts sit on two of the three servers (balancedness 2/3).
The workload streams greedy requests at a fixed concurrency (`--warmup-s` unmeasured), for `--phase-s` seconds, then
`Rebalance` replicates the hot experts (`--redundant-experts` extra copies per layer) while the
streams continue, then `--phase-s` more seconds. Every phase is bounded; requests failed must be 0.

  python bench/rebalance.py [--phase-s 25] [--warmup-s 15] [--concurrency 4] [--output-len 16] [--expert-servers 3]

Columns: phase, seconds, output tokens/s, time per output token p50/p99 (gaps between streamed
tokens of one request), requests completed and failed; then balancedness and placement versions.
"""
from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from moemesh.contracts.wire import control_grpc, control_pb2
from moemesh.launcher.child import Child, stop_all
from moemesh.launcher.health import wait_serving
from moemesh.launcher.mesh import serve_argv
from moemesh.launcher.ports import free_port
from moemesh.rpc.config import RpcConfig
from moemesh.rpc.protos import load
from moemesh.rpc.security import SecurityConfig
from moemesh.rpc.server import make_sync_channel
from moemesh.rpc.generation import build_request

gen_pb, gen_grpc = load("generation")
PROMPTS = [
    "What is the capital of France?", "Name three colours of the rainbow.", "Why is the sky blue?",
    "Write a haiku about the sea.", "What is two plus two?", "Describe a cat in one sentence.",
]


# the mesh token of the services this benchmark starts (one per run)
BENCH_TOKEN = secrets.token_urlsafe(32)
BENCH_RPC = RpcConfig(security=SecurityConfig(mesh_token=BENCH_TOKEN))


def start(children: list[Child], log_dir: Path, name: str, service: str, flags: dict, timeout_s: float, threads: int) -> str:
    """One service process; `threads` torch/OpenMP threads (oversubscribed OpenMP threads spin and
    make GEMM times erratic on a shared machine)."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "MOEMESH_MESH_TOKEN": BENCH_TOKEN}
    child = Child(name, serve_argv(service, {"host": "127.0.0.1", "port": port, **flags}), log_dir / f"{name}.log", env=env)
    children.append(child)
    address = f"127.0.0.1:{port}"
    wait_serving(address, timeout_s, alive=lambda: child.poll() is None, rpc=BENCH_RPC)
    return address


class Streams:
    """Closed-loop greedy streams; records (arrival time, gap since the previous token) per token."""

    def __init__(self, router: str, concurrency: int, output_len: int, deadline_s: float) -> None:
        self.router, self.output_len = router, output_len
        self.tokens: list[tuple[float, float | None]] = []
        self.done: list[float] = []
        self.failed: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._deadline = time.monotonic() + deadline_s
        self._threads = [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(concurrency)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _worker(self, i: int) -> None:
        with grpc.insecure_channel(self.router) as ch:
            stub = gen_grpc.GenerationStub(ch)
            n = i
            while not self._stop.is_set() and time.monotonic() < self._deadline:
                req = build_request(prompt=PROMPTS[n % len(PROMPTS)], max_new_tokens=self.output_len, temperature=0.0, ignore_eos=True)
                n += len(self._threads)
                last = None
                try:
                    for resp in stub.Generate(req, timeout=120):
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
            t.join(150)


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def phase_row(name: str, streams: Streams, t0: float, t1: float) -> str:
    toks = [(t, gap) for t, gap in streams.tokens if t0 <= t < t1]
    gaps = [g for _, g in toks if g is not None]
    done = sum(1 for t in streams.done if t0 <= t < t1)
    secs = t1 - t0
    return (f"{name:<8} {secs:7.1f} {len(toks) / secs:10.2f} {1e3 * percentile(gaps, 0.5):9.1f} {1e3 * percentile(gaps, 0.99):9.1f} "
            f"{done:9d}")


def busy(a, b, seconds: float) -> str:
    """Each expert server's busy seconds between two GetStatus answers, per second."""
    was = {s.server.server_id: s.busy_seconds for s in a.servers}
    return " ".join(f"{s.server.server_id}={(s.busy_seconds - was.get(s.server.server_id, 0.0)) / seconds:.2f}" for s in b.servers)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the demo model)")
    ap.add_argument("--expert-servers", type=int, default=3)
    ap.add_argument("--redundant-experts", type=int, default=4, help="extra expert copies per layer the rebalance may place")
    ap.add_argument("--top-k", type=int, default=2, help="routing top-k for the run (the skew)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--phase-s", type=float, default=25.0, help="seconds before and after the rebalance")
    ap.add_argument("--warmup-s", type=float, default=15.0, help="seconds of streaming before the measured phases")
    ap.add_argument("--start-timeout-s", type=float, default=300.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each expert server and the attention replica")
    args = ap.parse_args()
    if args.model is None:
        from moemesh.demo_model import ensure_demo_model

        args.model = str(ensure_demo_model())
    log_dir = Path(tempfile.mkdtemp(prefix="moemesh-bench-rebalance-"))
    children: list[Child] = []
    streams = None
    try:
        control = start(children, log_dir, "control", "control", {
            "model_dir": args.model, "expected_expert_servers": args.expert_servers, "heartbeat_interval_s": 0.5,
            "redundant_experts": args.redundant_experts, "rebalance_min_tokens": 1}, args.start_timeout_s, 1)
        for i in range(args.expert_servers):
            start(children, log_dir, f"expert-{i}", "expert", {"model_dir": args.model, "control_addr": control, "transport": "grpc",
                                                               "load_window_s": args.phase_s}, args.start_timeout_s, args.threads)
        attention = start(children, log_dir, "attention", "attention", {"model_dir": args.model, "control_addr": control,
                                                                         "num_threads": args.threads}, args.start_timeout_s, args.threads)
        router = start(children, log_dir, "router", "router", {"model_dir": args.model, "attention": attention}, args.start_timeout_s, 1)
        with make_sync_channel(control, BENCH_RPC) as ch:
            ctl = control_grpc.ControlServiceStub(ch)
            ctl.SetKnobs(control_pb2.SetKnobsRequest(top_k=args.top_k), timeout=120)
            streams = Streams(router, args.concurrency, args.output_len, deadline_s=args.warmup_s + 3 * args.phase_s + 180)
            streams.start()
            time.sleep(args.warmup_s)
            t_start = time.monotonic()
            start_st = ctl.GetStatus(control_pb2.GetStatusRequest(), timeout=30)
            time.sleep(args.phase_s)
            before = ctl.GetStatus(control_pb2.GetStatusRequest(), timeout=30)
            t_switch = time.monotonic()
            resp = ctl.Rebalance(control_pb2.RebalanceRequest(), timeout=300)
            while True:  # "during" lasts until the attention replica runs the new version
                st = ctl.GetStatus(control_pb2.GetStatusRequest(), timeout=30)
                if all(r.adopted_version >= resp.placement_version for r in st.replicas) and not st.switching:
                    break
                time.sleep(0.05)
            t_switched = time.monotonic()
            switched_st = ctl.GetStatus(control_pb2.GetStatusRequest(), timeout=30)
            time.sleep(args.phase_s)
            t_end = time.monotonic()
            after = ctl.GetStatus(control_pb2.GetStatusRequest(), timeout=30)
            streams.stop()
        print(f"bench/rebalance: {args.model}, {args.expert_servers} expert servers, top-k {args.top_k}, "
              f"{args.concurrency} greedy streams x {args.output_len} tokens, {args.threads} torch thread(s) per service "
              f"(CPU, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; logs in {log_dir})")
        print(f"{'phase':<8} {'seconds':>7} {'tokens/s':>10} {'tpot p50':>9} {'tpot p99':>9} {'completed':>9}   (tpot in ms)")
        print(phase_row("before", streams, t_start, t_switch))
        print(phase_row("during", streams, t_switch, t_switched))
        print(phase_row("after", streams, t_switched, t_end))
        print(f"balancedness (window load, mean/max server load): before {before.balancedness:.3f} on v{before.placement_version}, "
              f"solver's plan {resp.balancedness_after:.3f}, after {after.balancedness:.3f} on v{after.placement_version} "
              f"(switched={resp.switched}, {resp.moves} expert copies loaded{', ' + resp.reason if resp.reason else ''})")
        print(f"expert servers' compute time per phase second (busy fraction): before {busy(start_st, before, t_switch - t_start)}, "
              f"after {busy(switched_st, after, t_end - t_switched)}")
        print(f"requests failed: {len(streams.failed)}" + (f" ({streams.failed[:3]})" if streams.failed else ""))
        return 0 if not streams.failed else 1
    finally:
        if streams is not None:
            streams.stop()
        stop_all(list(reversed(children)), 10)


if __name__ == "__main__":
    sys.exit(main())
