"""The HTTP gateway's own cost, without a model: a gateway process in front of a scripted router
(bench/scripted_router.py: every Generate answers one-token messages, one every `--step-ms`), and
`--concurrency` streams of the same workload sent through the gateway's streamed `/v1/completions`
(bench/sse_client.py) and straight to the scripted router's `Generate` (grpc.aio), alternating which
goes first, `--rounds` times, each at 1 output token and at `--output-len`.

Per path it prints the CPU time of the gateway process and of the client (this process) per request
(at one token: the request's own cost) and per further token (the difference to the `--output-len`
run, over the extra tokens: the cost of a streamed chunk), the arrival delay (the client's send to
the router's Generate, on the machine's monotonic clock, p50 and max over the requests: how late the
gateway delivers concurrent requests, which decides whether the router batches them together), and
the time to first token p50; medians over the rounds.

    python bench/gateway_overhead.py [--concurrency 16] [--num-requests 64] [--output-len 64]
        [--step-ms 20] [--rounds 3] [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # as a script: the repository root instead of bench/ on sys.path
    _root = Path(__file__).resolve().parent.parent
    sys.path[:] = [str(_root)] + [p for p in sys.path if Path(p or ".").resolve() != _root / "bench"]

from bench.gateway_vs_router import run_http
from bench.scripted_router import KEY_IDS

ROOT = Path(__file__).resolve().parent.parent


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def started(argv: list[str]) -> tuple[subprocess.Popen, str]:
    """A child process and the first line it prints (its port, or its ready line)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])))
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise RuntimeError(f"{' '.join(argv[:3])} did not start (exit {proc.returncode})")
    return proc, line.strip()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=20.0, help="the scripted router's time between two tokens of a stream")
    p.add_argument("--rounds", type=int, default=3, help="measure both paths this many times, alternating which goes first")
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    if ns.rounds < 1 or ns.output_len < 2 or ns.step_ms < 0 or ns.prompt_len < KEY_IDS:
        p.error(f"need --rounds >= 1, --output-len >= 2, --step-ms >= 0 and --prompt-len >= {KEY_IDS}, got "
                f"{ns.rounds}, {ns.output_len}, {ns.step_ms} and {ns.prompt_len}")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    from router_svc.loadgen import Workload, run_grpc

    tmp = tempfile.TemporaryDirectory(prefix="gateway-overhead-")
    arrivals = Path(tmp.name) / "arrivals.txt"
    procs = []
    try:
        router_proc, port = started([sys.executable, "-m", "bench.scripted_router", str(ns.step_ms / 1000), str(arrivals)])
        procs.append(router_proc)
        router = f"127.0.0.1:{port}"
        http_port = free_port()
        gateway_proc, _ = started([sys.executable, "-m", "gateway_svc", "--router", router, "--port", str(http_port)])
        procs.append(gateway_proc)
        pids = {"gateway": gateway_proc.pid, "client": os.getpid()}
        paths = {"gateway": lambda w: run_http(f"127.0.0.1:{http_port}", w), "router": lambda w: run_grpc(router, w, first_at_text=True)}
        warm = Workload(num_requests=ns.concurrency, concurrency=ns.concurrency, prompt_len=ns.prompt_len, output_len=4, seed=1)
        for run in paths.values():
            asyncio.run(run(warm))

        def measure(name: str, work: Workload) -> dict:
            arrivals.write_text("")
            before = {k: cpu_s(p) for k, p in pids.items()}
            result = asyncio.run(paths[name](work))
            after = {k: cpu_s(p) for k, p in pids.items()}
            arrived = {}
            for line in arrivals.read_text().splitlines():
                t, *ids = line.split()
                arrived[tuple(map(int, ids))] = float(t)
            prompts = work.prompts()
            delays = [1000 * (arrived[tuple(prompts[i][:KEY_IDS])] - t.submitted) for i, t in enumerate(result.timings)]
            return {"gateway_cpu_ms": 1000 * (after["gateway"] - before["gateway"]) / work.num_requests,
                    "client_cpu_ms": 1000 * (after["client"] - before["client"]) / work.num_requests,
                    "arrival_p50_ms": statistics.median(delays), "arrival_max_ms": max(delays),
                    "ttft_p50_ms": result.summary()["ttft_p50_ms"]}

        rounds = []
        for r in range(ns.rounds):
            order = ["gateway", "router"] if r % 2 == 0 else ["router", "gateway"]
            one, full = ({name: measure(name, Workload(num_requests=ns.num_requests, concurrency=ns.concurrency,
                                                       prompt_len=ns.prompt_len, output_len=out)) for name in order}
                         for out in (1, ns.output_len))
            rounds.append({name: {
                "per_request_cpu_ms": {k: round(one[name][f"{k}_cpu_ms"], 3) for k in pids},
                "per_token_cpu_ms": {k: round((full[name][f"{k}_cpu_ms"] - one[name][f"{k}_cpu_ms"]) / (ns.output_len - 1), 4) for k in pids},
                "arrival_p50_ms": round(full[name]["arrival_p50_ms"], 2), "arrival_max_ms": round(full[name]["arrival_max_ms"], 2),
                "ttft_p50_ms": full[name]["ttft_p50_ms"],
            } for name in order})
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait()
        tmp.cleanup()

    def med(name: str, *keys: str) -> float:
        values = []
        for r in rounds:
            v = r[name]
            for k in keys:
                v = v[k]
            values.append(v)
        return round(statistics.median(values), 4)

    summary = {"workload": {"concurrency": ns.concurrency, "num_requests": ns.num_requests, "prompt_len": ns.prompt_len,
                            "output_len": ns.output_len, "step_ms": ns.step_ms},
               "rounds": rounds,
               "median": {name: {"gateway_cpu_ms_per_request": med(name, "per_request_cpu_ms", "gateway"),
                                 "gateway_cpu_ms_per_token": med(name, "per_token_cpu_ms", "gateway"),
                                 "client_cpu_ms_per_request": med(name, "per_request_cpu_ms", "client"),
                                 "client_cpu_ms_per_token": med(name, "per_token_cpu_ms", "client"),
                                 "arrival_p50_ms": med(name, "arrival_p50_ms"), "arrival_max_ms": med(name, "arrival_max_ms"),
                                 "ttft_p50_ms": med(name, "ttft_p50_ms")} for name in ("gateway", "router")}}
    if ns.json:
        print(json.dumps(summary))
        return 0
    print(f"{ns.concurrency} streams, {ns.num_requests} requests, {ns.output_len} tokens each, a token every {ns.step_ms:g} ms; "
          f"medians of {ns.rounds} rounds (CPU per request at 1 token; per further token):")
    for name, m in summary["median"].items():
        print(f"  {name:>8}: gateway CPU {m['gateway_cpu_ms_per_request']:6.3f} ms/request {m['gateway_cpu_ms_per_token']:7.4f} ms/token;"
              f"  client CPU {m['client_cpu_ms_per_request']:6.3f} ms/request {m['client_cpu_ms_per_token']:7.4f} ms/token;"
              f"  arrival p50 {m['arrival_p50_ms']:6.2f} max {m['arrival_max_ms']:7.2f} ms;  TTFT p50 {m['ttft_p50_ms']:7.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
