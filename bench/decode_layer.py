"""A decoder layer's decode step in one compiled call against fewer fused: one engine, decode steps alternated.

    python bench/decode_layer.py [--compare attention|experts] [--shape qwen3-sparse] [--model DIR]
        [--experts-dtype bf16|fp8|mxfp4|nvfp4] [--steps 300] [--threads 2] [--concurrent 1]

On a decode step the decoder runs each layer's norms, q/k/v, q/k norm and rope, attention, o,
post-attention norm, router and top-k plan as one call into the compiled CPU kernels
(`kernels.cpu.step_ops.decode_layer`) where its weights allow it, and op by op from Python
otherwise (the same values); where the experts are held in process, a MoE layer's experts run in
the same call, and a run of consecutive MoE layers goes in one call (`decode_layers_experts`). This
loads the checkpoint once, gives the engine greedy requests, then times `engine.step()` both ways,
in turns (which goes first alternates), so that both see the same machine and the same weights; it
prints each side's median ms per step and the ratio.

--compare attention (default): the attention half in one call against op by op, the experts
  submitted apart on both sides.
--compare experts: the MoE layers in one call per run against the attention half in one call and
  the experts submitted apart, layer by layer.
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
from moemesh.moe.local_experts import LocalExperts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def compare(p: argparse.ArgumentParser) -> None:
        p.add_argument("--compare", choices=("attention", "experts"), default="attention",
                       help="attention: the attention half in one call or op by op; experts: the MoE layer's experts in that call or apart")
    return alternated_steps.parse_args(__doc__, argv, extra=compare)


def main(argv: list[str] | None = None) -> dict[str, float]:
    ns = parse_args(argv)
    model = model_dir(ns)
    torch.set_num_threads(ns.threads)
    engine = greedy_engine(model, ns, 2 * ns.steps)
    fused = list(engine.model.layers)
    op_by_op = [dataclasses.replace(lyr, fused=None) for lyr in fused]
    experts = engine.experts
    held = sum(lyr.fused is not None for lyr in fused)
    moe_held = sum(lyr.fused is not None and lyr.router is not None and experts.decode_kernels(i) is not None
                   for i, lyr in enumerate(fused)) if isinstance(experts, LocalExperts) else 0

    def step_with(layers, with_experts: bool):
        def step() -> None:
            engine.model.layers = layers
            if with_experts:
                experts.__dict__.pop("decode_kernels", None)
            else:  # this engine's experts submitted apart: no layer's experts held for the one call
                experts.decode_kernels = lambda layer: None
            engine.step()
        return step

    if ns.compare == "attention":
        what, other = "attention half in one call", "op by op"
        sides = {"one call": step_with(fused, False), other: step_with(op_by_op, False)}
    else:
        what, other = "MoE layers in one call per run", "experts apart"
        sides = {"one call": step_with(fused, True), other: step_with(fused, False)}
    med = alternate(ns.steps, sides)
    engine.model.layers = fused
    experts.__dict__.pop("decode_kernels", None)
    print(f"{model}: experts {ns.experts_dtype or 'as stored'}, {ns.concurrent} decoding, {ns.threads} thread(s), "
          f"{ns.steps} steps each, alternated; {held} of {len(fused)} layers held for the one call, {moe_held} with their experts")
    print(f"{what}: median {med['one call']:.2f} ms/step; {other}: {med[other]:.2f} ms/step; "
          f"{other} / one call {med[other] / med['one call']:.3f}")
    return {"one_call_ms": med["one call"], "other_ms": med[other], "layers_held": float(held), "moe_layers_held": float(moe_held)}


if __name__ == "__main__":
    main()
