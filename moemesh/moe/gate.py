"""Softmax top-k gate.

Shape legend: T tokens, E experts, H hidden, K top-k.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Routing:
    """expert_ids [T, K] int64, or None when K == E and the columns are the experts in order (every
    token chooses every expert); weights [T, K] float32 (the combine weights of each choice)."""

    expert_ids: Tensor | None
    weights: Tensor


def softmax_topk(router_logits: Tensor, top_k: int, normalize: bool) -> Routing:
    """router_logits [T, E] -> Routing. Softmax in float32 over all E, keep the top k,
    renormalize the kept weights to sum to 1 when `normalize`. top_k == E keeps every expert: the
    weights stay in expert order (expert_ids None), no top-k sort."""
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]: the logits converted, then softmax
    if top_k == num_experts:
        weights, ids = probs, None  # [T, E]
    else:
        weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, K]
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(expert_ids=ids, weights=weights)
