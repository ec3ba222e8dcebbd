"""The grouped expert MLP: the one entry point that models and expert servers call.

Shape legend:
  N  rows handed to the experts (token-expert assignments), grouped by expert
  G  experts that receive rows in this call (in the order of `expert_idx`)
  E  experts held in an ExpertWeights
  H  hidden size, I  expert intermediate size
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

ACTIVATIONS = ("silu", "swiglu_oai")


@dataclass
class ExpertWeights:
    """One layer's experts as one process holds them (dense layout).

    gate_up       [E, 2I, H]  rows [0, I) are the gate projection, rows [I, 2I) the up projection
    down          [E, H, I]
    gate_up_bias  [E, 2I] or None
    down_bias     [E, H] or None
    activation    "silu": silu(g) * u;  "swiglu_oai" (gpt-oss): g=clamp(g,max=7), u=clamp(u,-7,7),
                  (u + 1) * g * sigmoid(1.702 g)
    """

    gate_up: Tensor
    down: Tensor
    gate_up_bias: Tensor | None = None
    down_bias: Tensor | None = None
    activation: str = "silu"

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.gate_up.shape[1] // 2


def apply_activation(gate_up: Tensor, activation: str) -> Tensor:
    """gate_up [n, 2I] -> [n, I]."""
    inter = gate_up.shape[-1] // 2
    g, u = gate_up[..., :inter], gate_up[..., inter:]
    if activation == "silu":
        return torch.nn.functional.silu(g) * u
    g = g.clamp(max=7.0)
    u = u.clamp(min=-7.0, max=7.0)
    return (u + 1.0) * g * torch.sigmoid(1.702 * g)


def grouped_expert_mlp(x: Tensor, expert_idx: Tensor, counts: Tensor, w: ExpertWeights) -> Tensor:
    """Run each expert's MLP on its contiguous slice of rows.

    x [N, H] rows grouped by expert; expert_idx [G] int64 indices into w's E; counts [G] int64,
    sum(counts) == N. Returns [N, H] in x.dtype (unweighted expert outputs).
    """
    out = torch.empty_like(x)
    start = 0
    for e, n in zip(expert_idx.tolist(), counts.tolist()):
        if n == 0:
            continue
        rows = x[start : start + n]  # [n, H]
        h = rows @ w.gate_up[e].t()  # [n, 2I]
        if w.gate_up_bias is not None:
            h = h + w.gate_up_bias[e]
        h = apply_activation(h, w.activation)  # [n, I]
        y = h @ w.down[e].t()  # [n, H]
        if w.down_bias is not None:
            y = y + w.down_bias[e]
        out[start : start + n] = y
        start += n
    return out
