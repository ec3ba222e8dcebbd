"""`moemesh bench`: a load generator over gRPC (concurrent streams or Poisson arrivals), optionally
side by side with the same workload on the in-process engine. Prints throughput, TTFT and
time-per-output-token p50/p99, the mesh/in-process ratio, and writes a PNG plot."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from moemesh.cli.up import RunMeshConfig, add_mesh_arguments, mesh_config


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="load-test a mesh over gRPC (optionally against the in-process engine)")
    p.add_argument("--addr", default=None, metavar="HOST:PORT", help="a running router (default: start a mesh for the run)")
    add_mesh_arguments(p)
    p.add_argument("--num-requests", type=int, default=32, metavar="N")
    p.add_argument("--concurrency", type=int, default=16, metavar="N", help="concurrent streams (closed loop)")
    p.add_argument("--rate", type=float, default=0.0, metavar="R", help="Poisson arrivals per second instead (0 = closed loop)")
    p.add_argument("--prompt-len", type=int, default=32, metavar="N")
    p.add_argument("--output-len", type=int, default=32, metavar="N")
    p.add_argument("--compare-engine", action="store_true", help="also run the workload on the in-process engine (needs --model or the demo model)")
    p.add_argument("--engine-micro-batches", type=int, choices=(1, 2), default=1, help="micro-batches of the in-process engine")
    p.add_argument("--plot", default="bench.png", metavar="PNG", help="where to write the plot ('' = none)")
    p.add_argument("--json", action="store_true", help="print the summaries as one JSON object")
    p.set_defaults(func=run)


def workload(ns: argparse.Namespace):
    from router_svc.loadgen import Workload

    return Workload(num_requests=ns.num_requests, concurrency=ns.concurrency, rate=ns.rate,
                    prompt_len=ns.prompt_len, output_len=ns.output_len)


def run(ns: argparse.Namespace) -> int:
    """A bad flag raises ValueError naming it: one line from moemesh.cli.main, status 2."""
    from moemesh.cli.checks import check_address

    if ns.addr:
        check_address("--addr", ns.addr)
    results = bench(ns, workload(ns))
    report(results, ns)
    return 0


def bench(ns: argparse.Namespace, work) -> list:
    from moemesh.launcher.mesh import Mesh
    from router_svc.loadgen import run_engine, run_grpc

    results = []
    api_key = os.environ.get("MOEMESH_API_KEY", "")  # the router's API key, when it has one (as `moemesh generate` reads it)
    if ns.addr:
        from moemesh.svc_config import from_sources

        spec = from_sources(RunMeshConfig, None, ns).mesh  # --model, --experts-dtype and --dense-dtype only matter to --compare-engine
        results.append(asyncio.run(run_grpc(ns.addr, work, name=f"mesh {ns.addr}", api_key=api_key)))
    else:
        cfg = mesh_config(ns)
        spec = cfg.mesh
        mesh = Mesh(spec, cfg.log_dir)
        try:
            router, _ = mesh.start()
            print(f"moemesh bench: mesh up (router={router}, {spec.expert_servers} expert servers, {spec.transport})", file=sys.stderr)
            results.append(asyncio.run(run_grpc(router, work, name=f"mesh/{spec.transport}", api_key=api_key)))
        finally:
            mesh.stop()
    if ns.compare_engine:
        if not spec.model_dir:
            raise ValueError("--compare-engine needs --model when benchmarking a running mesh (--addr)")
        results.append(run_engine(in_process_engine(spec, ns.engine_micro_batches), work))
    return results


def in_process_engine(spec, micro_batches: int):
    """The engine the mesh is compared with: the mesh's model, expert and dense formats and all-experts switch."""
    from moemesh.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model_dir=spec.model_dir, experts_dtype=spec.experts_dtype, dense_dtype=spec.dense_dtype,
                                  micro_batches=micro_batches,
                                  all_experts_path=spec.all_experts_path))


def report(results: list, ns: argparse.Namespace) -> None:
    from router_svc.loadgen import plot

    summaries = [r.summary() for r in results]
    out: dict = {"runs": summaries}
    if len(results) == 2 and results[1].tokens_per_s > 0:
        out["mesh_over_in_process"] = round(results[0].tokens_per_s / results[1].tokens_per_s, 3)
    if ns.plot:
        plot(results, ns.plot)
        out["plot"] = ns.plot
    if ns.json:
        print(json.dumps(out))
        return
    for s in summaries:
        print(f"{s['name']:>24}: {s['tokens_per_s']:9.1f} tok/s  TTFT p50 {s['ttft_p50_ms']:8.1f} ms  p99 {s['ttft_p99_ms']:8.1f} ms"
              f"  TPOT p50 {s['tpot_p50_ms']:7.1f} ms  p99 {s['tpot_p99_ms']:7.1f} ms  ({s['requests']} requests, {s['wall_s']} s)")
    if "mesh_over_in_process" in out:
        print(f"mesh / in-process throughput: {out['mesh_over_in_process']:.2f}x")
    if ns.plot:
        print(f"plot: {ns.plot}")
