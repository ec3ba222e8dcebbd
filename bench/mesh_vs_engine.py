"""Mesh vs in-process engine: 2 expert servers, batch 1 and 16 concurrent streams, over the gRPC and
the torch.distributed transport, on a named checkpoint shape.

    python bench/mesh_vs_engine.py [--shape demo|qwen3-sparse|qwen3-sparse-tiny] [--model DIR]
        [--concurrency 1,16] [--requests-per-stream 2] [--output-len 32] [--plot mesh_vs_engine.png]
        [--no-all-experts-path]

Checkpoints come from bench/shapes.py (`demo`: the demo model, built if absent; `qwen3-sparse`: a
random Qwen3-MoE of realistic proportions, 64 experts of which top-8 per token, built once into
~/.cache/moemesh/bench); `--model DIR` takes any checkpoint. Both sides compute in the checkpoint's
dtype with its experts as stored. `--no-all-experts-path` turns off, on both sides (the engine's
`EngineConfig.all_experts_path`, the expert servers' `--no-all-experts-path`), the path that runs
steps sending every token to every expert as two matmuls over the experts side by side, so what it
gains over `kernels.moe_mlp` is the difference of two runs.

For each concurrency level it prints throughput, TTFT and TPOT p50/p99 of each run and the
mesh/in-process throughput ratio (target >= 0.7x), plus the weight bytes a decode step at that batch
must read (active experts: expected distinct experts per layer for the shape's top-k; attention; LM
head; see bench/traffic.py) and the GB/s each run reached at its throughput (tokens/s divided by the
streams = decode steps/s; prefill included, so a lower bound), next to the copy bandwidth measured
at the start; and writes a PNG. Each target first
gets `--warmup-requests` untimed requests (streams and links open, allocators warm) on both sides
alike. Every target is measured `--rounds` times, the meshes in rotated order (on a shared machine the
first mesh of a run can measure lower than the same mesh later: docs/benchmarks.md); each round's
ratios are against that round's in-process run, and the median is reported.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

if __name__ == "__main__":  # as a script: the repository root instead of bench/ on sys.path
    _root = Path(__file__).resolve().parent.parent
    sys.path[:] = [str(_root)] + [p for p in sys.path if Path(p or ".").resolve() != _root / "bench"]

from bench.args import positive_ints
from bench.shapes import SHAPES, checkpoint_dir

TARGET_RATIO = 0.7



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="demo", help="named checkpoint (bench/shapes.py)")
    p.add_argument("--model", default=None, help="a checkpoint directory instead of --shape")
    p.add_argument("--expert-servers", type=int, default=2)
    p.add_argument("--concurrency", type=positive_ints, default=(1, 16), help="concurrent streams, one workload each")
    p.add_argument("--requests-per-stream", type=int, default=2, help="requests per stream (a workload sends concurrency x this)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--transports", default="grpc,dist")
    p.add_argument("--rounds", type=int, default=3,
                   help="measure every target this many times, in rotated order (noisy shared machines): the median ratio is reported")
    p.add_argument("--warmup-requests", type=int, default=16,
                   help="untimed requests (4 output tokens each, all at once) sent to each target before it is measured; 0 = none")
    p.add_argument("--plot", default="mesh_vs_engine.png")
    p.add_argument("--all-experts-path", action=argparse.BooleanOptionalAction, default=True,
                   help="the all-experts path on both sides (EngineConfig.all_experts_path, the expert servers' flag)")
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    if ns.rounds < 1 or ns.warmup_requests < 0 or ns.requests_per_stream < 1 or ns.expert_servers < 1:
        p.error(f"need --rounds >= 1, --warmup-requests >= 0, --requests-per-stream >= 1 and --expert-servers >= 1, got "
                f"{ns.rounds}, {ns.warmup_requests}, {ns.requests_per_stream} and {ns.expert_servers}")
    transports = tuple(t for t in ns.transports.split(",") if t)
    bad = [t for t in transports if t not in ("grpc", "dist", "auto")]
    if not transports or bad:
        p.error(f"--transports: expected a comma-separated list of grpc, dist, auto, got {ns.transports!r}")
    ns.transports = transports
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)

    from moemesh.engine import EngineConfig, LLMEngine
    from moemesh.launcher.mesh import Mesh, MeshSpec
    from router_svc.loadgen import Workload, plot, run_engine, run_grpc

    from bench.traffic import copy_bandwidth_gbs, expert_bytes, step_bytes

    limit = copy_bandwidth_gbs()
    model = ns.model or str(checkpoint_dir(ns.shape, progress=lambda m: print(m, file=sys.stderr)))
    works = {c: Workload(num_requests=c * ns.requests_per_stream, concurrency=c, prompt_len=ns.prompt_len, output_len=ns.output_len)
             for c in ns.concurrency}
    # first calls open streams and links and warm allocators on either side: not what is measured
    warmup = Workload(num_requests=ns.warmup_requests, concurrency=ns.warmup_requests, prompt_len=ns.prompt_len, output_len=4, seed=1) \
        if ns.warmup_requests > 0 else None
    transports = list(ns.transports)
    engine = LLMEngine(EngineConfig(model_dir=model, all_experts_path=ns.all_experts_path))
    mcfg, dtype = engine.model_config, engine.dtype
    per_expert = expert_bytes(model, dtype, None)
    traffic = {c: step_bytes(mcfg, dtype, per_expert, c) for c in ns.concurrency}
    if warmup:
        run_engine(engine, warmup, name="warmup")
    rounds = []  # per round, per concurrency: the mesh results (in `transports` order) and the in-process one
    for r in range(ns.rounds):
        by_name = {}
        for transport in transports[r % len(transports):] + transports[:r % len(transports)]:  # rotated: no transport always first
            mesh = Mesh(MeshSpec(model_dir=model, expert_servers=ns.expert_servers, transport=transport,
                                 all_experts_path=ns.all_experts_path))
            by_name[transport] = measure_mesh(mesh, works, warmup, f"mesh/{transport}", run_grpc)
        rounds.append({c: ([by_name[t][c] for t in transports], run_engine(engine, work, name=f"in-process c{c}"))
                       for c, work in works.items()})
    if ns.plot:
        plot([x for c in ns.concurrency for x in rounds[-1][c][0] + [rounds[-1][c][1]]], ns.plot)

    ratios = {f"mesh/{t} c{c}": [round(rd[c][0][i].tokens_per_s / rd[c][1].tokens_per_s, 3) for rd in rounds]
              for c in ns.concurrency for i, t in enumerate(transports)}

    def run_summary(result, c: int) -> dict:
        s = result.summary()
        s["weight_gbs"] = round(traffic[c].total * s["tokens_per_s"] / c / 1e9, 2)  # bytes/step x steps/s
        return s

    summary = {
        "model": model,
        "shape": None if ns.model else ns.shape,
        "all_experts_path": ns.all_experts_path,
        "workloads": {str(c): w.__dict__ for c, w in works.items()},
        "copy_bandwidth_gbs": round(limit, 2),
        "step_bytes": {str(c): {"total": round(t.total), "experts": round(t.experts), "distinct_experts": round(t.distinct_experts, 2),
                                "attention": t.attention, "lm_head": t.lm_head} for c, t in traffic.items()},
        "rounds": [{str(c): [run_summary(x, c) for x in meshes + [eng]] for c, (meshes, eng) in rd.items()} for rd in rounds],
        "ratios": ratios,
        "median_ratios": {name: statistics.median(v) for name, v in ratios.items()},
        "target": TARGET_RATIO,
    }
    if ns.json:
        print(json.dumps(summary))
        return 0
    print(f"{model}: {mcfg.architecture}, {mcfg.num_experts} experts, top-{mcfg.top_k}, {dtype}; "
          f"{ns.expert_servers} expert servers; all-experts path {'on' if ns.all_experts_path else 'off'}; "
          f"copy bandwidth {limit:.1f} GB/s")
    for c, t in traffic.items():
        print(f"batch {c}: {t.describe()}")
    for r, rd in enumerate(summary["rounds"]):
        print(f"round {r + 1}:")
        for c, runs in rd.items():
            for s in runs:
                print(f"  {s['name']:>16}: {s['tokens_per_s']:8.1f} tok/s  TTFT p50 {s['ttft_p50_ms']:8.1f} p99 {s['ttft_p99_ms']:8.1f} ms"
                      f"  TPOT p50 {s['tpot_p50_ms']:7.1f} p99 {s['tpot_p99_ms']:7.1f} ms  weights {s['weight_gbs']:6.1f} GB/s")
    for name, values in ratios.items():
        each = ", ".join(f"{v:.2f}x" for v in values)
        print(f"{name} / in-process: median {statistics.median(values):.2f}x over {len(values)} rounds ({each}); target >= {TARGET_RATIO}x")
    return 0


def measure_mesh(mesh, works: dict, warmup, name: str, run_grpc) -> dict:
    """Start `mesh`, send the untimed warm-up, measure each workload (keyed by concurrency), stop it."""
    try:
        router, _ = mesh.start()
        if warmup:
            asyncio.run(run_grpc(router, warmup, name="warmup"))
        return {c: asyncio.run(run_grpc(router, work, name=f"{name} c{c}")) for c, work in works.items()}
    finally:
        mesh.stop()


if __name__ == "__main__":
    sys.exit(main())
