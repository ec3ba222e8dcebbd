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
    returns a Future resolving to [T, H] in x.dtype: for each token, the sum over its kept experts of
    weight * expert(x[token]) (tokens without a kept expert get zeros).
    In-process implementations return an already-completed future; remote ones return at once and
    resolve when every expert server has answered, so the caller can overlap other work.
    """

    def submit(self, layer: int, x: Tensor, plan: DispatchPlan) -> Future: ...


def completed(value: Tensor) -> Future:
    """A Future that already holds `value`."""
    fut: Future = Future()
    fut.set_result(value)
    return fut
