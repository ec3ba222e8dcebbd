"""Mesh vs in-process engine on the demo model: 2 expert servers, 16 concurrent streams, over the
gRPC and the torch.distributed transport. Prints throughput, TTFT and TPOT p50/p99 of each run and
the mesh/in-process throughput ratio (target >= 0.7x), and writes a PNG. Each target first gets
`--warmup-requests` untimed requests (streams and links open, allocators warm) on both sides alike.
Every target is measured `--rounds` times, the meshes in rotated order (on a shared 2-core machine
the first mesh of a run was measured up to 0.15x lower than the same mesh later); each round's
ratios are against that round's in-process run, and the median is reported.

    python bench/mesh_vs_engine.py [--num-requests 32] [--output-len 32] [--plot mesh_vs_engine.png]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys

TARGET_RATIO = 0.7


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the demo model, built if absent)")
    p.add_argument("--expert-servers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--transports", default="grpc,dist")
    p.add_argument("--rounds", type=int, default=3,
                   help="measure every target this many times, in rotated order (noisy shared machines): the median ratio is reported")
    p.add_argument("--warmup-requests", type=int, default=16,
                   help="untimed requests (4 output tokens each, all at once) sent to each target before it is measured; 0 = none")
    p.add_argument("--plot", default="mesh_vs_engine.png")
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    if ns.rounds < 1 or ns.warmup_requests < 0:
        p.error(f"--rounds must be >= 1 and --warmup-requests >= 0, got {ns.rounds} and {ns.warmup_requests}")

    from moemesh.engine import EngineConfig, LLMEngine
    from moemesh.launcher.mesh import Mesh, MeshSpec
    from router_svc.loadgen import Workload, plot, run_engine, run_grpc

    model = ns.model
    if model is None:
        from moemesh.demo_model import ensure_demo_model

        model = str(ensure_demo_model())
    work = Workload(num_requests=ns.num_requests, concurrency=ns.concurrency, prompt_len=ns.prompt_len, output_len=ns.output_len)
    # first calls open streams and links and warm allocators on either side: not what is measured
    warmup = Workload(num_requests=ns.warmup_requests, concurrency=ns.warmup_requests, prompt_len=ns.prompt_len, output_len=4, seed=1) \
        if ns.warmup_requests > 0 else None
    transports = ns.transports.split(",")
    engine = LLMEngine(EngineConfig(model_dir=model))
    if warmup:
        run_engine(engine, warmup, name="warmup")
    rounds = []  # per round: the mesh results (in `transports` order) and the in-process one
    for r in range(ns.rounds):
        by_name = {}
        for transport in transports[r % len(transports):] + transports[:r % len(transports)]:  # rotated: no transport always first
            by_name[transport] = measure_mesh(Mesh(MeshSpec(model_dir=model, expert_servers=ns.expert_servers, transport=transport)),
                                              work, warmup, f"mesh/{transport}", run_grpc)
        rounds.append(([by_name[t] for t in transports], run_engine(engine, work)))
    if ns.plot:
        plot(rounds[-1][0] + [rounds[-1][1]], ns.plot)
    ratios = {f"mesh/{t}": [round(meshes[i].tokens_per_s / eng.tokens_per_s, 3) for meshes, eng in rounds] for i, t in enumerate(transports)}
    summary = {
        "workload": work.__dict__,
        "rounds": [{"runs": [x.summary() for x in meshes + [eng]]} for meshes, eng in rounds],
        "ratios": ratios,
        "median_ratios": {name: statistics.median(v) for name, v in ratios.items()},
        "target": TARGET_RATIO,
    }
    if ns.json:
        print(json.dumps(summary))
    else:
        for r, round_ in enumerate(summary["rounds"]):
            print(f"round {r + 1}:")
            for s in round_["runs"]:
                print(f"  {s['name']:>12}: {s['tokens_per_s']:8.1f} tok/s  TTFT p50 {s['ttft_p50_ms']:8.1f} p99 {s['ttft_p99_ms']:8.1f} ms"
                      f"  TPOT p50 {s['tpot_p50_ms']:7.1f} p99 {s['tpot_p99_ms']:7.1f} ms")
        for name, values in ratios.items():
            each = ", ".join(f"{v:.2f}x" for v in values)
            print(f"{name} / in-process: median {statistics.median(values):.2f}x over {len(values)} rounds ({each}); target >= {TARGET_RATIO}x")
    return 0


def measure_mesh(mesh, work, warmup, name: str, run_grpc):
    """Start `mesh`, send the untimed warm-up, measure `work`, stop it."""
    try:
        router, _ = mesh.start()
        if warmup:
            asyncio.run(run_grpc(router, warmup, name="warmup"))
        return asyncio.run(run_grpc(router, work, name=name))
    finally:
        mesh.stop()


if __name__ == "__main__":
    sys.exit(main())
