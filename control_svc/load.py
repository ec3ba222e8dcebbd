"""The observed expert load: each live expert server's sliding-window token counts, summed.

Shape letters: L MoE layers, E logical experts.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch


def window_load(stats: Iterable[object], layers: Sequence[int], num_experts: int) -> torch.Tensor:
    """[L, E] int64 tokens per (MoE layer in `layers` order, logical expert) over the servers'
    load windows; `stats` are moemesh.v1.ExpertStats (None entries and unknown layers are skipped)."""
    row = {layer: i for i, layer in enumerate(layers)}
    out = torch.zeros(len(layers), num_experts, dtype=torch.int64)
    for s in stats:
        if s is None:
            continue
        for load in s.loads:
            i = row.get(load.layer)
            if i is not None and 0 <= load.expert_id < num_experts:
                out[i, load.expert_id] += load.tokens
    return out
