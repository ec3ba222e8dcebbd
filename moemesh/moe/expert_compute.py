"""The seam between a MoE layer and whoever computes its experts (in process or remote).

Shape legend: N rows (token-expert assignments) grouped by expert, G experts with rows, H hidden.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol, runtime_checkable

from torch import Tensor


class ExpertCompute(Protocol):
    """Computes expert MLPs for one MoE layer.

    `submit(layer, x, expert_ids, counts)`:
      layer       index of the decoder layer
      x           [N, H] rows grouped by expert, in the order of expert_ids
      expert_ids  [G] int64 logical expert ids (ascending, each once)
      counts      [G] int64 rows per expert, sum == N
    returns a Future resolving to [N, H] unweighted expert outputs in x.dtype.
    In-process implementations return an already-completed future; remote ones return at once and
    resolve when every expert server has answered, so the caller can overlap other work.
    """

    def submit(self, layer: int, x: Tensor, expert_ids: Tensor, counts: Tensor) -> Future: ...


@runtime_checkable
class AllExpertsCompute(Protocol):
    """Optionally offered by an ExpertCompute that can run a layer whose every token goes to every
    expert (top-k == E, nothing dropped) without dispatching rows.

    `submit_all(layer, x, weights)`: x [T, H], weights [T, E] float32 combine weights (expert order);
    returns a Future of [T, H] = sum_e weights[:, e] * expert_e(x) in x.dtype, or None when it cannot
    for this layer (the caller then uses `submit` with a dispatch plan)."""

    def submit_all(self, layer: int, x: Tensor, weights: Tensor) -> Future | None: ...


def completed(value: Tensor) -> Future:
    """A Future that already holds `value`."""
    fut: Future = Future()
    fut.set_result(value)
    return fut
