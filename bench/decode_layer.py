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
import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # as a script: the repository root instead of bench/ on sys.path
    _root = Path(__file__).resolve().parent.parent
    sys.path[:] = [str(_root)] + [p for p in sys.path if Path(p or ".").resolve() != _root / "bench"]

from bench import alternated_steps
from bench.alternated_steps import alternate, greedy_engine, model_dir


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return alternated_steps.parse_args(__doc__, argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    ns = parse_args(argv)
    model = model_dir(ns)
    torch.set_num_threads(ns.threads)
    engine = greedy_engine(model, ns, 2 * ns.steps)
    fused = list(engine.model.layers)
    op_by_op = [dataclasses.replace(lyr, fused=None) for lyr in fused]
    held = sum(lyr.fused is not None for lyr in fused)

    def step_with(layers):
        def step() -> None:
            engine.model.layers = layers
            engine.step()
        return step

    med = alternate(ns.steps, {"one call": step_with(fused), "op by op": step_with(op_by_op)})
    engine.model.layers = fused
    print(f"{model}: experts {ns.experts_dtype or 'as stored'}, {ns.concurrent} decoding, {ns.threads} thread(s), "
          f"{ns.steps} steps each, alternated; {held} of {len(fused)} layers held for the one call")
    print(f"attention half in one call: median {med['one call']:.2f} ms/step; op by op: {med['op by op']:.2f} ms/step; "
          f"op by op / one call {med['op by op'] / med['one call']:.3f}")
    return {"one_call_ms": med["one call"], "op_by_op_ms": med["op by op"], "layers_held": float(held)}


if __name__ == "__main__":
    main()
