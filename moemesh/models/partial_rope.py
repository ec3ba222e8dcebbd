"""Partial rotary embeddings (GLM-4.5: rope on the first `partial_rotary_factor` of each head) run as a
full-width rotate-half rope, so the engine's standard attention and KV cache serve them unchanged.

Shape legend: P positions, Dh head dim, D rotary dims (D <= Dh, even), NH heads.

Partial rope rotates pairs (i, i + D/2) for i < D/2 and passes dims [D, Dh) through. A full-width
rotate-half rope rotates pairs (j, j + Dh/2). Reordering each head's dims with `head_permutation`
puts every rotated pair where the full-width rope expects it and the pass-through dims on the other
pairs, whose cos is 1 and sin 0 in `full_width_table`. Queries and keys get the same reordering (their
projection rows, biases and q/k-norm weights are permuted at load time), so every q.k product, and
hence the attention, is unchanged; values are not touched.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.formats import FP8BlockExperts, permute_fp8_rows
from moemesh.config import ModelConfig
from moemesh.models.deepseek_v3.config import rope_parameters
from moemesh.models.deepseek_v3.yarn_rope import build_rotary_table
from moemesh.models.layers import RotaryTable


@dataclass(frozen=True)
class PermutedRope:
    """perm [Dh] (new dim j holds old dim perm[j]) and the full-width table [P, Dh] for that layout."""

    perm: Tensor
    table: RotaryTable


def permuted_rope(cfg: ModelConfig, rotary_dim: int) -> PermutedRope:
    """The model's rope (its rope_parameters, yarn included) on the first `rotary_dim` dims of each
    head, as a full-width rope over permuted head dims."""
    partial = build_rotary_table(rope_parameters(cfg.raw), rotary_dim, cfg.max_position_embeddings)
    return PermutedRope(perm=head_permutation(cfg.head_dim, rotary_dim), table=full_width_table(partial, cfg.head_dim))


def head_permutation(head_dim: int, rotary_dim: int) -> Tensor:
    """perm [Dh] int64: new dim j holds old dim perm[j]."""
    if rotary_dim % 2 or head_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
    half, rhalf = head_dim // 2, rotary_dim // 2
    passing = list(range(rotary_dim, head_dim))
    npass = half - rhalf  # pass-through dims in each half of the new layout
    first = list(range(rhalf)) + passing[:npass]
    second = list(range(rhalf, rotary_dim)) + passing[npass:]
    return torch.tensor(first + second, dtype=torch.int64)


def permute_heads(w, num_heads: int, perm: Tensor):
    """Rows (or entries) [NH*Dh, ...] grouped by head -> the same with each head's dims reordered. A
    BlockwiseFP8 matrix as stored ([1, NH*Dh, K], read with dense_dtype "fp8") keeps its bytes and
    scales (`permute_fp8_rows`: each head's rows must lie in one block of rows)."""
    head_dim = perm.numel()
    if isinstance(w, FP8BlockExperts):
        index = (torch.arange(num_heads)[:, None] * head_dim + perm.to(torch.long)[None, :]).reshape(-1)  # [NH*Dh]
        return permute_fp8_rows(w, index)
    return w.reshape(num_heads, head_dim, *w.shape[1:])[:, perm].reshape(w.shape)


def full_width_table(partial: RotaryTable, head_dim: int) -> RotaryTable:
    """cos, sin [P, D] of the partial rope -> [P, Dh] for the permuted layout (cos 1, sin 0 elsewhere)."""
    p, d = partial.cos.shape
    half, rhalf = head_dim // 2, d // 2
    cos = torch.ones(p, head_dim, dtype=partial.cos.dtype)
    sin = torch.zeros(p, head_dim, dtype=partial.sin.dtype)
    for dst, src in ((0, 0), (half, rhalf)):
        cos[:, dst : dst + rhalf] = partial.cos[:, src : src + rhalf]
        sin[:, dst : dst + rhalf] = partial.sin[:, src : src + rhalf]
    return RotaryTable(cos=cos, sin=sin)
