"""Grouped top-k sigmoid gate (DeepSeek-V3, Kimi-K2, GLM-4.5 MoE).

Shape legend: T tokens, E experts, G expert groups, K top-k, H hidden.

The algorithm, as DeepSeek-V3 defines it:
  1. scores = sigmoid(logits)                                   [T, E]   (float32)
  2. biased = scores + e_score_correction_bias                  [T, E]   used only for *selection*
  3. group score = sum of the top-2 biased scores of each group  [T, G]
  4. keep the `topk_group` best groups; experts of other groups are out
  5. pick the top-k experts among the kept groups by biased score
  6. weights = the *unbiased* scores of the picked experts; divided by their sum (+1e-20) when
     `norm_topk_prob`; then multiplied by `routed_scaling_factor`.

Ties are broken towards the lower index, at both the group and the expert step (a stable descending
sort), so the selection is deterministic where `torch.topk` does not promise an order.
"""
from __future__ import annotations

import torch
from torch import Tensor

from moemesh.moe.gate import Routing

NORM_EPS = 1e-20


def stable_topk_indices(x: Tensor, k: int) -> Tensor:
    """x [..., N] -> indices [..., k] of the k largest entries, ties to the lower index."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def grouped_topk(
    router_logits: Tensor,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    correction_bias: Tensor | None = None,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
) -> Routing:
    """router_logits [T, E] -> Routing(expert_ids [T, K], weights [T, K] float32)."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got shape {list(router_logits.shape)}")
    num_tokens, num_experts = router_logits.shape
    if n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_group ({n_group}) must be >= 1 and divide the number of experts ({num_experts})")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    per_group = num_experts // n_group
    if not 1 <= top_k <= topk_group * per_group:
        raise ValueError(f"top_k must be in [1, topk_group * experts per group = {topk_group * per_group}], got {top_k}")
    if correction_bias is not None and correction_bias.shape != (num_experts,):
        raise ValueError(f"correction_bias must be [E={num_experts}], got shape {list(correction_bias.shape)}")

    scores = torch.sigmoid(router_logits.float())  # [T, E]
    biased = scores if correction_bias is None else scores + correction_bias.float()  # [T, E]
    if n_group > 1 and topk_group < n_group:
        grouped = biased.view(num_tokens, n_group, per_group)  # [T, G, E/G]
        best_two = min(2, per_group)
        group_scores = grouped.topk(best_two, dim=-1).values.sum(dim=-1)  # [T, G]
        kept_groups = stable_topk_indices(group_scores, topk_group)  # [T, topk_group]
        group_mask = torch.zeros(num_tokens, n_group, dtype=torch.bool, device=biased.device)
        group_mask.scatter_(1, kept_groups, True)  # [T, G]
        expert_mask = group_mask.repeat_interleave(per_group, dim=1)  # [T, E]
        biased = biased.masked_fill(~expert_mask, float("-inf"))
    expert_ids = stable_topk_indices(biased, top_k)  # [T, K]
    weights = scores.gather(1, expert_ids)  # [T, K]
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + NORM_EPS)
    weights = weights * routed_scaling_factor
    return Routing(expert_ids=expert_ids, weights=weights)
