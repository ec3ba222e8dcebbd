"""Mesh vs in-process engine on the demo model: 2 expert servers, 16 concurrent streams, over the
gRPC and the torch.distributed transport. Prints throughput, TTFT and TPOT p50/p99 of each run and
the mesh/in-process throughput ratio (target >= 0.7x), and writes a PNG. Each target first gets
`--warmup-requests` untimed requests (streams and links open, allocators warm) on both sides alike.

    python bench/mesh_vs_engine.py [--num-requests 32] [--output-len 32] [--plot mesh_vs_engine.png]
"""
from __future__ import annotations

import argparse
import asyncio
import json
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
    p.add_argument("--warmup-requests", type=int, default=16,
                   help="untimed requests (4 output tokens each, all at once) sent to each target before it is measured; 0 = none")
    p.add_argument("--plot", default="mesh_vs_engine.png")
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)

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
    results = []
    for transport in ns.transports.split(","):
        mesh = Mesh(MeshSpec(model_dir=model, expert_servers=ns.expert_servers, transport=transport))
        try:
            router, _ = mesh.start()
            if warmup:
                asyncio.run(run_grpc(router, warmup, name="warmup"))
            results.append(asyncio.run(run_grpc(router, work, name=f"mesh/{transport}")))
        finally:
            mesh.stop()
    engine = LLMEngine(EngineConfig(model_dir=model))
    if warmup:
        run_engine(engine, warmup, name="warmup")
    engine_result = run_engine(engine, work)
    results.append(engine_result)
    if ns.plot:
        plot(results, ns.plot)
    summary = {
        "workload": work.__dict__,
        "runs": [r.summary() for r in results],
        "ratios": {r.name: round(r.tokens_per_s / engine_result.tokens_per_s, 3) for r in results[:-1]},
        "target": TARGET_RATIO,
    }
    if ns.json:
        print(json.dumps(summary))
    else:
        for s in summary["runs"]:
            print(f"{s['name']:>12}: {s['tokens_per_s']:8.1f} tok/s  TTFT p50 {s['ttft_p50_ms']:8.1f} p99 {s['ttft_p99_ms']:8.1f} ms"
                  f"  TPOT p50 {s['tpot_p50_ms']:7.1f} p99 {s['tpot_p99_ms']:7.1f} ms")
        for name, ratio in summary["ratios"].items():
            print(f"{name} / in-process: {ratio:.2f}x (target >= {TARGET_RATIO}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
