"""Split a dense SwiGLU MLP into experts that, all selected with weight 1/E, reproduce it exactly.

Shapes: H hidden, I dense intermediate, E experts, I/E neurons per expert.
Dense MLP: `down[H, I] @ (silu(gate[I, H] @ x) * (up[I, H] @ x))`. Its neurons are independent, so
splitting the I rows of gate/up (and the I columns of down) into E slices gives E experts whose
outputs sum to the dense output. A router with zero logits and top-k = E weights each expert 1/E,
so each expert's down projection is scaled by E.
"""
from __future__ import annotations

import torch


def split_dense_mlp(
    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate [I, H], up [I, H], down [H, I] -> (w1s [E, I/E, H], w3s [E, I/E, H], w2s [E, H, I/E]).

    `w1`/`w3` are Mixtral's gate/up projections, `w2` its down projection, already scaled by E.
    """
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if gate.dim() != 2 or up.shape != gate.shape:
        raise ValueError(f"gate and up must both be [I, H], got gate {tuple(gate.shape)} and up {tuple(up.shape)}")
    inter, hidden = gate.shape
    if down.shape != (hidden, inter):
        raise ValueError(f"down must be [H, I] = [{hidden}, {inter}], got {tuple(down.shape)}")
    if inter % num_experts:
        raise ValueError(f"num_experts ({num_experts}) must divide the intermediate size ({inter})")
    per = inter // num_experts
    w1s = gate.reshape(num_experts, per, hidden)  # [E, I/E, H]
    w3s = up.reshape(num_experts, per, hidden)  # [E, I/E, H]
    w2s = down.reshape(hidden, num_experts, per).permute(1, 0, 2) * num_experts  # [E, H, I/E]
    return w1s.contiguous(), w3s.contiguous(), w2s.contiguous()


def merge_experts(w1s: torch.Tensor, w3s: torch.Tensor, w2s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `split_dense_mlp`: (w1s, w3s, w2s) -> dense (gate [I, H], up [I, H], down [H, I])."""
    if w1s.dim() != 3 or w3s.shape != w1s.shape:
        raise ValueError(f"w1s and w3s must both be [E, I/E, H], got {tuple(w1s.shape)} and {tuple(w3s.shape)}")
    num_experts, per, hidden = w1s.shape
    if w2s.shape != (num_experts, hidden, per):
        raise ValueError(f"w2s must be [E, H, I/E] = [{num_experts}, {hidden}, {per}], got {tuple(w2s.shape)}")
    gate = w1s.reshape(num_experts * per, hidden)  # [I, H]
    up = w3s.reshape(num_experts * per, hidden)  # [I, H]
    down = (w2s / num_experts).permute(1, 0, 2).reshape(hidden, num_experts * per)  # [H, I]
    return gate, up, down
