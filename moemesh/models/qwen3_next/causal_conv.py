"""Gated DeltaNet's short causal convolution (depthwise, kernel K, SiLU) with its carried state.

Shape legend: C channels (the q, k, v projections side by side), K kernel size, n tokens of one
sequence, B sequences.

The state of a sequence is its last K-1 inputs [C, K-1] (zeros before its first token), so a prompt
run in pieces, or token by token, sees exactly the inputs a single pass sees.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def conv_prefill(x: Tensor, weight: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One sequence: x [n, C], weight [C, K], state [C, K-1] -> (silu(conv) [n, C], new state [C, K-1])."""
    ext = torch.cat([state.to(x.dtype), x.transpose(0, 1)], dim=-1)  # [C, K-1+n]
    out = F.conv1d(ext[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])[0]  # [C, n]
    return F.silu(out).to(x.dtype).transpose(0, 1), ext[:, ext.shape[-1] - state.shape[-1] :]


def conv_step(x: Tensor, weight: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One token per sequence: x [B, C], weight [C, K], state [B, C, K-1] -> ([B, C], new state [B, C, K-1])."""
    ext = torch.cat([state.to(x.dtype), x[..., None]], dim=-1)  # [B, C, K]
    out = F.conv1d(ext.to(weight.dtype), weight[:, None, :], groups=weight.shape[0])[..., 0]  # [B, C]
    return F.silu(out).to(x.dtype), ext[..., 1:]
