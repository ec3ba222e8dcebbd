"""The seam between a MoE layer and whoever computes its experts (in process or remote).

Shape legend: T tokens, H hidden.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

from torch import Tensor

from moemesh.moe.dispatch import DispatchPlan


class ExpertCompute(Protocol):
    """Computes one MoE layer's routed experts and combines them.

    `submit(layer, x, plan)`:
      layer  index of the decoder layer
      x      [T, H] the layer's tokens (each once; the plan names the rows)
      plan   the dispatch plan the layer built from its gate
    returns [T, H] in x.dtype, or a Future resolving to it: for each token, the sum over its kept
    experts of weight * expert(x[token]) (tokens without a kept expert get zeros).
    In-process implementations compute at once and return the tensor; remote ones return a Future at
    once, resolved when every expert server has answered, so the caller can overlap other work.
    Callers take the tensor with `expert_output`.
    """

    def submit(self, layer: int, x: Tensor, plan: DispatchPlan) -> Tensor | Future: ...


def expert_output(submitted: Tensor | Future) -> Tensor:
    """What `ExpertCompute.submit` returned, as the tensor (waiting for a Future)."""
    return submitted if isinstance(submitted, Tensor) else submitted.result()
