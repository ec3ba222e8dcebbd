"""Decode steps with the experts in one format against the same experts in bf16: two engines in one process, steps alternated.

    python bench/format_steps.py [--experts-dtype mxfp4|nvfp4|fp8] [--blocks 3] [--shape qwen3-sparse]
        [--model DIR] [--steps 64] [--threads 2] [--concurrent 1]

The engine benches (`engine_vs_transformers.py`, `engine_vs_llamacpp.py`) compare each format's best
run of 32 or 64 tokens with bf16's best, runs taken seconds apart; on a shared host such a ratio
moves by 0.1-0.2x between runs of the same code. Here both engines (experts in bf16, and in
--experts-dtype; every other matrix as stored) live in this process and their decode steps are
timed in turns, step by step (which goes first alternates), so that both see the same moments of
the machine; the medians per step compare them. Each of --blocks blocks gives both engines fresh
greedy requests (the same prompts) and times --steps steps of each, so the contexts stay those of
a short generation (the default: 64 tokens, as the llama.cpp bench's runs); each block's ratio is
printed, then the median over the blocks and their range.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # as a script: the repository root instead of bench/ on sys.path
    _root = Path(__file__).resolve().parent.parent
    sys.path[:] = [str(_root)] + [p for p in sys.path if Path(p or ".").resolve() != _root / "bench"]

from bench import alternated_steps
from bench.alternated_steps import alternate, greedy_engine, greedy_requests, model_dir

BASE = "bf16"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def blocks(p: argparse.ArgumentParser) -> None:
        p.add_argument("--blocks", type=int, default=3, help="blocks of --steps alternated steps, fresh requests in each")

    ns = alternated_steps.parse_args(__doc__, argv, steps=64, extra=blocks)
    if ns.experts_dtype is None:
        ns.experts_dtype = "mxfp4"
    if ns.experts_dtype == BASE:
        raise SystemExit(f"--experts-dtype: compare a format other than {BASE} with {BASE}")
    if ns.blocks < 1:
        raise SystemExit(f"--blocks: need at least 1, got {ns.blocks}")
    return ns


def main(argv: list[str] | None = None) -> dict[str, float]:
    ns = parse_args(argv)
    model = model_dir(ns)
    torch.set_num_threads(ns.threads)
    fmt = ns.experts_dtype
    engines = {name: greedy_engine(model, argparse.Namespace(**{**vars(ns), "experts_dtype": name}), ns.steps)
               for name in (BASE, fmt)}
    print(f"{model}: experts {fmt} against {BASE} (other matrices as stored), {ns.concurrent} decoding, "
          f"{ns.threads} thread(s); {ns.blocks} block(s) of {ns.steps} steps each, alternated step by step")
    ratios = []
    for block in range(ns.blocks):
        if block:
            for engine in engines.values():
                greedy_requests(engine, ns, ns.steps, tag=f"b{block}-")
        med = alternate(ns.steps, {name: engine.step for name, engine in engines.items()})
        ratios.append(med[BASE] / med[fmt])
        print(f"block {block + 1}: {BASE} median {med[BASE]:.2f} ms/step, {fmt} {med[fmt]:.2f} ms/step; "
              f"{fmt} is {ratios[-1]:.3f}x {BASE}'s rate")
    mid = statistics.median(ratios)
    print(f"{fmt} / {BASE} rate: median over the blocks {mid:.3f}x (blocks {min(ratios):.3f}x to {max(ratios):.3f}x)")
    return {"median_ratio": mid, "min_ratio": min(ratios), "max_ratio": max(ratios), "blocks": float(len(ratios))}


if __name__ == "__main__":
    main()
