"""`LayerExperts`: one MoE layer's experts as one process holds them, and the computation of a
layer's routed rows over them. The in-process `LocalExperts` and the expert server's `ExpertShard`
both hold their layers as `LayerExperts`.

Shape legend: T tokens handed in, N rows (kept token-expert pairs) grouped by expert, G experts that
receive rows, E experts held, H hidden.

A call runs `kernels.moe_mlp` (gather, routed MLP, weighted combine). One case takes another path:
when every token goes to every held expert (a model whose top-k equals its number of experts: the
in-process plan's weights by expert, `every_expert`, or rows that say so, as an expert server
receives them), dense experts run side by side as two plain matmuls (`ConcatenatedExperts`). That path is
optional (`all_experts_path`: `EngineConfig.all_experts_path`, the expert server's config field), so
whether it still pays next to `moe_mlp` can be measured.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping

import psutil
import torch
from torch import Tensor

from kernels import ExpertWeights
from kernels.moe_mlp import moe_mlp
from moemesh.models.layers import packing_applies
from moemesh.moe.concatenated_experts import ConcatenatedExperts

AUTO_PACK_MEMORY_SHARE = 0.25


@dataclass(frozen=True)
class LayerExperts:
    """expert_ids    [E] logical ids held, ascending: local index i holds expert expert_ids[i]
    weights       the E experts in that order
    concatenated  the same experts side by side (dense experts without biases; None otherwise, or
                  when the all-experts path is off); its per-expert weights are views of it, so the
                  layout costs no second copy unless `packed`
    index         logical id -> local index"""

    expert_ids: tuple[int, ...]
    weights: ExpertWeights
    concatenated: ConcatenatedExperts | None = None
    index: Mapping[int, int] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def hold(cls, expert_ids: Iterable[int], w: ExpertWeights, all_experts_path: bool = True) -> "LayerExperts":
        """w's experts (in the order of expert_ids); with `all_experts_path`, dense experts are also
        laid side by side, their [E, .., ..] weights re-viewed from that storage."""
        ids = tuple(int(e) for e in expert_ids)
        cat = None
        if all_experts_path:
            adopted = ConcatenatedExperts.adopt(w)
            if adopted is not None:
                cat, w = adopted
        return cls(ids, w, cat, {e: i for i, e in enumerate(ids)})

    def packed(self) -> "LayerExperts":
        """The same, with a oneDNN-packed copy of the concatenated experts where packing applies
        (memory for speed: a second copy of the expert weights)."""
        if self.concatenated is None:
            return self
        return replace(self, concatenated=self.concatenated.packed() or self.concatenated)

    def __call__(self, x: Tensor, token_idx: Tensor, row_weight: Tensor, expert_idx: Tensor, counts: Tensor) -> Tensor:
        """x [T, H]; token_idx [N] int64 token of each row; row_weight [N] float32; expert_idx [G] int64
        local indices (each once); counts [G] int64 rows per expert -> [T, H] in x.dtype, each token's
        weighted sum over its rows. Rows that send every token to every held expert in token order
        run as `every_expert`."""
        if token_idx.numel() == 0:
            return torch.zeros_like(x)
        cat = self.concatenated
        if cat is not None and cat.gate_up.dtype == x.dtype:
            t = x.shape[0]
            if routes_every_token(t, token_idx, expert_idx, counts, cat.num_experts):
                g = expert_idx.numel()
                by_expert = torch.zeros(cat.num_experts, t, dtype=torch.float32, device=x.device)  # [E, T]
                by_expert.index_copy_(0, expert_idx, row_weight.view(g, t).float())
                return cat.mlp(x, by_expert.t())
        return moe_mlp(x, token_idx, row_weight, expert_idx, counts, self.weights)

    def every_expert(self, x: Tensor, by_expert: Tensor) -> Tensor | None:
        """x [T, H], by_expert [T, E] float32 combine weights of every token for every held expert (in
        local order) -> [T, H] in x.dtype, two matmuls over the experts side by side; None when the
        layer holds no concatenated layout in x.dtype (the caller then runs rows)."""
        cat = self.concatenated
        if cat is None or cat.gate_up.dtype != x.dtype:
            return None
        return cat.mlp(x, by_expert)


def routes_every_token(num_tokens: int, token_idx: Tensor, expert_idx: Tensor, counts: Tensor, num_held: int) -> bool:
    """Whether rows grouped by expert give every one of the `num_held` experts every token, in token
    order (expert_idx naming each held expert once, as a validated request does)."""
    g = expert_idx.numel()
    if g != num_held or token_idx.numel() != g * num_tokens or not bool((counts == num_tokens).all()):
        return False
    tokens = torch.arange(num_tokens, device=token_idx.device)
    return bool((token_idx.view(g, num_tokens) == tokens).all())


def all_experts_path_by_default(top_k: int, num_experts: int) -> bool:
    """Whether to hold the all-experts layout when not told: only for a model whose own top-k routes
    every token to every expert. A sparse model's calls never take that path, and the layout changes
    how the per-expert weights are held for `moe_mlp` (float32 [in, out], which the compiled CPU
    kernels do not read; bfloat16 down [H, E*I], each expert's rows E*I apart instead of contiguous)."""
    return top_k == num_experts


def pack_by_default(top_k: int, num_experts: int, dtype: torch.dtype, device: torch.device, copy_bytes: int) -> bool:
    """Whether to hold the packed copy of the concatenated experts when not told: only for a model
    whose own top-k routes every token to every expert (a sparse model never takes that path, and the
    copy doubles expert memory), where packing applies (`packing_applies`), and when the copy takes
    at most AUTO_PACK_MEMORY_SHARE of the memory available now."""
    if top_k != num_experts or not packing_applies(dtype, device):
        return False
    return copy_bytes <= AUTO_PACK_MEMORY_SHARE * psutil.virtual_memory().available
