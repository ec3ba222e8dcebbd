"""HTTP gateway vs the router's gRPC on the same mesh: `--concurrency` streams of the same
workload (random prompt ids, greedy, exactly `--output-len` tokens each; fresh prompts for every
run, so no run finds an earlier run's prompts in the replicas' prefix cache) sent once through the
gateway's `/v1/completions` (SSE) and once straight to the router's `Generate` (grpc.aio),
alternating which goes first, `--rounds` times. Prints tokens/s and TTFT p50/p99 of each run, the
gateway/router throughput ratio (target >= 0.95x) and the p50 TTFT the gateway adds (target <= 5 ms),
both as the median over the rounds.

The gateway's time to first token is taken at the first SSE chunk carrying text (a first token whose
text is held back as an incomplete UTF-8 character counts at the next chunk), and the router's at
the first `Generate` message carrying text, the same moment for a client that shows text; its token
count comes from the final usage chunk. Both clients run in this process, so their own costs are in the
figures, taken from the mesh on the same cores: the HTTP side reads over bench/sse_client.py (raw
asyncio streams), no costlier per request and per event than the gRPC side's grpc.aio client (httpx,
used before, cost several times more and sent some of the concurrent requests late; see
docs/benchmarks.md).

    python bench/gateway_vs_router.py [--shape demo|qwen3-sparse] [--model DIR] [--num-requests 64]
        [--output-len 64] [--rounds 3] [--json]

Checkpoints come from bench/shapes.py (`demo`: the demo model, built if absent); `--model DIR`
takes any checkpoint.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

if __name__ == "__main__":  # as a script: the repository root instead of bench/ on sys.path
    _root = Path(__file__).resolve().parent.parent
    sys.path[:] = [str(_root)] + [p for p in sys.path if Path(p or ".").resolve() != _root / "bench"]

from bench.shapes import SHAPES, checkpoint_dir

TARGET_RATIO = 0.95
TARGET_ADDED_TTFT_MS = 5.0


async def closed_loop(n: int, concurrency: int, one) -> float:
    """Runs one(i) for i in range(n) on `concurrency` workers; returns the wall time."""
    queue = list(range(n))[::-1]

    async def worker() -> None:
        while queue:
            await one(queue.pop())

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
    return time.perf_counter() - start


async def run_http(address: str, work, name: str = "gateway"):
    """The workload through the gateway's streamed /v1/completions (prompt as token ids), one
    keep-alive connection per stream (bench/sse_client.py)."""
    from bench.sse_client import SseConnection
    from router_svc.loadgen import BenchResult, RequestTiming

    prompts = work.prompts()
    timings = [None] * work.num_requests
    host, port = address.rsplit(":", 1)
    # every connection opened before the clock starts (the gRPC side reuses one warm channel)
    idle = [await SseConnection(host, int(port)).open() for _ in range(min(work.concurrency, work.num_requests))]
    try:
        async def one(i: int) -> None:
            body = {"prompt": prompts[i], "max_tokens": work.output_len, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            conn = idle.pop()
            t = RequestTiming(time.perf_counter())
            try:
                async for chunk in conn.post_events("/v1/completions", body):
                    if not t.first and chunk["choices"] and chunk["choices"][0]["text"]:
                        t.first = time.perf_counter()
                    if chunk.get("usage"):
                        t.tokens = chunk["usage"]["completion_tokens"]
            finally:
                idle.append(conn)
            t.done = time.perf_counter()
            t.first = t.first or t.done
            timings[i] = t

        wall = await closed_loop(work.num_requests, work.concurrency, one)
    finally:
        for conn in idle:
            await conn.close()
    return BenchResult(name, wall, timings)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="demo", help="named checkpoint (bench/shapes.py)")
    p.add_argument("--model", default=None, help="a checkpoint directory instead of --shape")
    p.add_argument("--expert-servers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="measure both paths this many times, alternating which goes first")
    p.add_argument("--warmup-requests", type=int, default=16, help="untimed requests of the measured shape through each path first; 0 = none")
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    if ns.rounds < 1 or ns.warmup_requests < 0 or ns.expert_servers < 1:
        p.error(f"need --rounds >= 1, --warmup-requests >= 0 and --expert-servers >= 1, got "
                f"{ns.rounds}, {ns.warmup_requests} and {ns.expert_servers}")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    from moemesh.launcher.mesh import Mesh, MeshSpec
    from router_svc.loadgen import Workload, run_grpc

    model = ns.model or str(checkpoint_dir(ns.shape, progress=lambda msg: print(msg, file=sys.stderr)))
    work = Workload(num_requests=ns.num_requests, concurrency=ns.concurrency, prompt_len=ns.prompt_len, output_len=ns.output_len)
    mesh = Mesh(MeshSpec(model_dir=model, expert_servers=ns.expert_servers, http_port=0))
    rounds = []
    try:
        router, _ = mesh.start()
        paths = {"gateway": lambda w, name: run_http(mesh.http_addr, w, name), "router": lambda w, name: run_grpc(router, w, name, first_at_text=True)}
        if ns.warmup_requests:
            # the measured shape (streams, prompt and output length), so no timed run is the first to
            # meet its batch sizes
            warm = Workload(num_requests=ns.warmup_requests, concurrency=min(ns.concurrency, ns.warmup_requests),
                            prompt_len=ns.prompt_len, output_len=ns.output_len, seed=1)
            for name, run in paths.items():
                asyncio.run(run(warm, f"warmup/{name}"))
        for r in range(ns.rounds):
            order = ["gateway", "router"] if r % 2 == 0 else ["router", "gateway"]
            # prompts of their own for every run (the same length, fresh random ids): the replicas
            # cache prefixes, and a run repeating an earlier run's prompts would find them cached
            results = {name: asyncio.run(paths[name](replace(work, seed=2 + 2 * r + k), name)) for k, name in enumerate(order)}
            rounds.append((results["gateway"], results["router"]))
    finally:
        mesh.stop()
    ratios = [round(g.tokens_per_s / rt.tokens_per_s, 3) for g, rt in rounds]
    added = [round(g.summary()["ttft_p50_ms"] - rt.summary()["ttft_p50_ms"], 2) for g, rt in rounds]
    summary = {
        "workload": work.__dict__,
        "rounds": [{"gateway": g.summary(), "router": rt.summary()} for g, rt in rounds],
        "ratios": ratios, "added_ttft_p50_ms": added,
        "median_ratio": statistics.median(ratios), "median_added_ttft_p50_ms": statistics.median(added),
        "targets": {"ratio": TARGET_RATIO, "added_ttft_p50_ms": TARGET_ADDED_TTFT_MS},
    }
    if ns.json:
        print(json.dumps(summary))
        return 0
    for r, round_ in enumerate(summary["rounds"]):
        print(f"round {r + 1}:")
        for s in (round_["gateway"], round_["router"]):
            print(f"  {s['name']:>8}: {s['tokens_per_s']:9.1f} tok/s  TTFT p50 {s['ttft_p50_ms']:8.1f} ms  p99 {s['ttft_p99_ms']:8.1f} ms"
                  f"  ({s['requests']} requests, {s['output_tokens']} tokens, {s['wall_s']} s)")
    print(f"gateway / router throughput: {summary['median_ratio']:.3f}x (median of {ratios}; target >= {TARGET_RATIO}x)")
    print(f"TTFT p50 added by the gateway: {summary['median_added_ttft_p50_ms']:.2f} ms (median of {added}; target <= {TARGET_ADDED_TTFT_MS} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
