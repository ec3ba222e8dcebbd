"""The gpt-oss router: a linear layer with bias, the top-k logits, softmax over those k only.

Shape legend: T tokens, H hidden, E experts, K top-k.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moemesh.models.deepseek_v3.grouped_topk import stable_topk_indices
from moemesh.moe.gate import Routing


def topk_softmax_router(h: Tensor, weight: Tensor, bias: Tensor | None, top_k: int) -> Routing:
    """h [T, H], weight [E, H], bias [E] -> Routing(expert_ids [T, K], weights [T, K] float32).
    Logits in h's dtype (as gpt-oss computes them), ties to the lower expert index."""
    num_experts = weight.shape[0]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    logits = F.linear(h, weight, bias)  # [T, E]
    ids = stable_topk_indices(logits, top_k)  # [T, K]
    weights = torch.softmax(logits.gather(1, ids), dim=-1, dtype=logits.dtype)  # [T, K]
    return Routing(expert_ids=ids, weights=weights.float())
