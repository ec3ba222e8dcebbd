"""A decoder layer's attention half in one compiled call against op by op: one engine, decode steps alternated.

    python bench/decode_layer.py [--shape qwen3-sparse] [--model DIR] [--experts-dtype bf16|fp8|mxfp4|nvfp4]
        [--steps 300] [--threads 2] [--concurrent 1]

On a decode step the decoder runs each layer's norms, q/k/v, q/k norm and rope, attention, o,
post-attention norm, router and top-k plan as one call into the compiled CPU kernels
(`kernels.cpu.step_ops.decode_layer`) where its weights allow it, and op by op from Python
otherwise (the same values). This loads the checkpoint once, gives the engine greedy requests, then
times `engine.step()` with every layer's one-call weights in place and with them taken out, in
turns (which goes first alternates), so that both see the same machine and the same weights; it
prints each side's median ms per step and the ratio.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

if __name__ == "__main__":  # as a script: the repository root instead of bench/ on sys.path
    _root = Path(__file__).resolve().parent.parent
    sys.path[:] = [str(_root)] + [p for p in sys.path if Path(p or ".").resolve() != _root / "bench"]

from bench.shapes import SHAPES, checkpoint_dir

WARMUP_STEPS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-sparse", help="named checkpoint (bench/shapes.py)")
    p.add_argument("--model", default=None, help="a checkpoint directory instead of --shape")
    p.add_argument("--experts-dtype", default=None, help="expert weight format (EngineConfig.experts_dtype); unset: as stored")
    p.add_argument("--steps", type=int, default=300, help="timed decode steps of each side")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrent", type=int, default=1, help="greedy requests decoding together")
    ns = p.parse_args(argv)
    if ns.steps < 1 or ns.threads < 1 or ns.concurrent < 1:
        p.error(f"need --steps, --threads and --concurrent >= 1, got {ns.steps}, {ns.threads}, {ns.concurrent}")
    return ns


def main(argv: list[str] | None = None) -> dict[str, float]:
    from moemesh.engine import LLMEngine
    from moemesh.engine.config import EngineConfig
    from moemesh.engine.sampling_params import SamplingParams

    ns = parse_args(argv)
    model = ns.model or str(checkpoint_dir(ns.shape, progress=lambda msg: print(msg, file=sys.stderr)))
    torch.set_num_threads(ns.threads)
    engine = LLMEngine(EngineConfig(model_dir=model, experts_dtype=ns.experts_dtype, num_threads=ns.threads))
    params = SamplingParams(max_new_tokens=WARMUP_STEPS + 2 * ns.steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(ns.concurrent):
        engine.add_request(f"r{i}", [1 + i, 20 + i, 300 + i, 4000 + i, 55, 66], params)
    for _ in range(WARMUP_STEPS):
        engine.step()
    fused = list(engine.model.layers)
    sides = {"one call": fused, "op by op": [dataclasses.replace(lyr, fused=None) for lyr in fused]}
    held = sum(lyr.fused is not None for lyr in fused)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(ns.steps):
        for name in (("one call", "op by op") if i % 2 == 0 else ("op by op", "one call")):
            engine.model.layers = sides[name]
            t = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - t)
    engine.model.layers = fused
    med = {name: 1000 * statistics.median(v) for name, v in times.items()}
    print(f"{model}: experts {ns.experts_dtype or 'as stored'}, {ns.concurrent} decoding, {ns.threads} thread(s), "
          f"{ns.steps} steps each, alternated; {held} of {len(fused)} layers held for the one call")
    print(f"attention half in one call: median {med['one call']:.2f} ms/step; op by op: {med['op by op']:.2f} ms/step; "
          f"op by op / one call {med['op by op'] / med['one call']:.3f}")
    return {"one_call_ms": med["one call"], "op_by_op_ms": med["op by op"], "layers_held": float(held)}


if __name__ == "__main__":
    main()
