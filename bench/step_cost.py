"""The CPU work of one engine decode step: Python calls, torch operations, and milliseconds.

  python bench/step_cost.py [--shape demo|qwen3-sparse|qwen3-sparse-tiny] [--model DIR]
      [--dtype bfloat16|float32] [--experts-dtype fp8|mxfp4|nvfp4|...] [--dense-dtype fp8] [--concurrent 16] [--steps 20] [--threads 1] [--top 0]

--concurrent greedy requests decode together; after a few warm-up steps it prints, per decode step:
the Python function calls (cProfile, counted over 3 steps), the torch operations dispatched
(`TorchDispatchMode`, every aten call including views, over 2 steps), the wall and thread-CPU
milliseconds (median and fastest of --steps steps, no profiler attached), and over --steps more steps
the milliseconds inside the expert kernels, inside the one-call runs of MoE layers (attention halves
and experts in one compiled call, where the experts are held in process), inside the dense matmuls
and outside them (the step's fixed work). The two counts do not depend on the machine's load, so they
compare commits on a shared machine where the timings cannot; --top N also lists the N most frequent
of each.
"""
from __future__ import annotations

import argparse
import cProfile
import collections
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if __name__ == "__main__":  # as a script: the repository root instead of bench/ on sys.path
    _root = Path(__file__).resolve().parent.parent
    sys.path[:] = [str(_root)] + [p for p in sys.path if Path(p or ".").resolve() != _root / "bench"]

from bench.shapes import SHAPES, checkpoint_dir
from kernels.prepare import DENSE_DTYPES

WARMUP_STEPS = 4
PROFILED_STEPS = 3
COUNTED_STEPS = 2


class OpCounter(TorchDispatchMode):
    """Counts the torch operations dispatched while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="demo")
    p.add_argument("--model", default=None, help="a checkpoint directory instead of --shape's")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--experts-dtype", default=None, help="expert weight format (EngineConfig.experts_dtype); unset: as stored")
    p.add_argument("--dense-dtype", choices=DENSE_DTYPES, default=None,
                   help="format of the attention projections, dense MLPs and LM head (EngineConfig.dense_dtype); unset: the compute dtype")
    p.add_argument("--concurrent", type=int, default=16)
    p.add_argument("--steps", type=int, default=20, help="timed decode steps")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--top", type=int, default=0, help="also list the N most frequent calls and operations")
    ns = p.parse_args(argv)
    if ns.concurrent < 1 or ns.steps < 1 or ns.threads < 1 or ns.top < 0:
        p.error(f"need --concurrent, --steps, --threads >= 1 and --top >= 0, got {ns.concurrent}, {ns.steps}, {ns.threads}, {ns.top}")
    return ns


def outside_the_gemms(engine, steps: int) -> tuple[float, float, float, float, float]:
    """Runs `steps` decode steps timing the calls into the routed experts (`kernels.moe_mlp.run_compiled`,
    the compiled kernels' call), into the one-call runs of MoE layers (`decode_layers_experts` as the
    decoder calls it: attention halves and experts together, where the experts are held in process)
    and into the dense matmuls (`moemesh.models.layers.linear`, wherever a loaded module holds it):
    median ms per step inside the expert calls, inside the one-call runs, inside the dense matmuls,
    outside all three, and the least ms outside. "Outside" is the step's fixed CPU work: norms, rope,
    attention, routing, Python (for the layers not in a one-call run)."""
    from moemesh.models import decoder, layers

    moe_module = sys.modules["kernels.moe_mlp"]
    inside = {"experts": 0.0, "runs": 0.0, "dense": 0.0}

    def timed(fn, key):
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                inside[key] += time.perf_counter() - t
        return call

    linear, run_compiled, runs = layers.linear, moe_module.run_compiled, decoder.decode_layers_experts
    holders = [m for m in list(sys.modules.values()) if getattr(m, "linear", None) is linear]
    for m in holders:
        m.linear = timed(linear, "dense")
    moe_module.run_compiled = timed(run_compiled, "experts")
    decoder.decode_layers_experts = timed(runs, "runs")
    per_step: dict[str, list[float]] = {"experts": [], "runs": [], "dense": [], "outside": []}
    try:
        for _ in range(steps):
            inside.update(experts=0.0, runs=0.0, dense=0.0)
            t = time.perf_counter()
            engine.step()
            total = time.perf_counter() - t
            for key, value in inside.items():
                per_step[key].append(value)
            per_step["outside"].append(total - sum(inside.values()))
    finally:
        for m in holders:
            m.linear = linear
        moe_module.run_compiled = run_compiled
        decoder.decode_layers_experts = runs
    median = lambda v: 1000 * sorted(v)[len(v) // 2]  # noqa: E731
    return (median(per_step["experts"]), median(per_step["runs"]), median(per_step["dense"]), median(per_step["outside"]),
            1000 * min(per_step["outside"]))


def main(argv: list[str] | None = None) -> int:
    from moemesh.engine import LLMEngine
    from moemesh.engine.config import EngineConfig
    from moemesh.engine.sampling_params import SamplingParams

    ns = parse_args(argv)
    model = ns.model or str(checkpoint_dir(ns.shape, progress=lambda msg: print(msg, file=sys.stderr)))
    torch.set_num_threads(ns.threads)
    engine = LLMEngine(EngineConfig(model_dir=model, dtype=ns.dtype, experts_dtype=ns.experts_dtype, dense_dtype=ns.dense_dtype,
                                    num_threads=ns.threads))
    total = WARMUP_STEPS + PROFILED_STEPS + COUNTED_STEPS + 2 * ns.steps
    params = SamplingParams(max_new_tokens=total + 1, temperature=0.0, ignore_eos=True)
    for i in range(ns.concurrent):  # short distinct prompts: one prefill step, then decode steps only
        engine.add_request(f"r{i}", [1 + i, 20 + i, 300 + i, 4000 + i, 55, 66], params)
    for _ in range(WARMUP_STEPS):
        engine.step()

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(PROFILED_STEPS):
        engine.step()
    profile.disable()
    calls = {f"{Path(f).name}:{line}({name})": v[1] / PROFILED_STEPS for (f, line, name), v in pstats.Stats(profile).stats.items()}

    ops = OpCounter()
    with ops:
        for _ in range(COUNTED_STEPS):
            engine.step()

    wall, cpu = [], []
    for _ in range(ns.steps):
        w, c = time.perf_counter(), time.thread_time()
        engine.step()
        wall.append(time.perf_counter() - w)
        cpu.append(time.thread_time() - c)
    wall.sort()
    cpu.sort()
    split = outside_the_gemms(engine, ns.steps)

    print(f"{model}: {ns.dtype}, experts {ns.experts_dtype or 'as stored'}, dense linears {ns.dense_dtype or ns.dtype}, "
          f"{ns.concurrent} decoding, {ns.threads} thread(s)")
    print(f"per decode step: {sum(calls.values()):.0f} Python calls, {sum(ops.counts.values()) / COUNTED_STEPS:.0f} torch ops; "
          f"wall ms median {1000 * wall[len(wall) // 2]:.2f} (fastest {1000 * wall[0]:.2f}), "
          f"thread CPU ms median {1000 * cpu[len(cpu) // 2]:.2f} (fastest {1000 * cpu[0]:.2f}) over {ns.steps} steps")
    print(f"in the expert kernels ms median {split[0]:.2f}, in the one-call MoE layer runs (attention and experts) "
          f"{split[1]:.2f}, in the dense linears {split[2]:.2f}; outside them ms median {split[3]:.2f} (least {split[4]:.2f}) "
          f"over {ns.steps} more steps")
    if ns.top:
        print("most frequent Python calls per step:")
        for name, n in sorted(calls.items(), key=lambda kv: -kv[1])[: ns.top]:
            print(f"  {n:8.1f}  {name}")
        print("most frequent torch ops per step:")
        for name, n in ops.counts.most_common(ns.top):
            print(f"  {n / COUNTED_STEPS:8.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
