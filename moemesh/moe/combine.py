"""Combine expert outputs back into token order, weighted by the gate.

Shape legend: T tokens, N rows (kept token-expert pairs), H hidden.
"""
from __future__ import annotations

import torch
from torch import Tensor

from moemesh.moe.dispatch import DispatchPlan


def combine(expert_out: Tensor, plan: DispatchPlan, num_tokens: int) -> Tensor:
    """expert_out [N, H] (rows in plan order) -> [T, H] = sum over each token's rows of weight * row.
    Weights apply in float32, the sum accumulates in expert_out's dtype."""
    if plan.uniform:
        num_experts = plan.expert_ids.shape[0]
        rows = expert_out.view(num_experts, num_tokens, -1)  # [E, T, H]
        weighted = (rows.float() * plan.weights.view(num_experts, num_tokens, 1)).to(expert_out.dtype)  # [E, T, H]
        return weighted.sum(0)  # [T, H]
    out = torch.zeros(num_tokens, expert_out.shape[-1], dtype=expert_out.dtype, device=expert_out.device)
    weighted = (expert_out.float() * plan.weights[:, None]).to(expert_out.dtype)  # [N, H]
    out.index_add_(0, plan.token_idx, weighted)
    return out
