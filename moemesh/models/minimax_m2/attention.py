"""MiniMax-M2 attention: grouped-query attention whose q and k are RMS-normalised over all heads
together (q_norm [NH*D], k_norm [KVH*D], not per head), then rotated on the first `rotary_dim` dims of
each head; no biases. Runs on the engine's paged attention core.

Shape legend: T tokens, H hidden, NH query heads, KVH key/value heads, D head dim.

The partial rope runs as a full-width rope over permuted head dims (models/partial_rope.py): q/k
projection rows and the norm weights are permuted per head at load; an RMS over all heads is the same
after a permutation, so every q.k is unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moemesh.checkpoint import CheckpointReader
from moemesh.config import ModelConfig
from moemesh.models.attention import paged_attention
from moemesh.models.batch import BatchMeta
from moemesh.models.layers import RotaryTable, apply_rope_signed, cat_rows, linear, matmul_layout, rms_norm, rope_for_step
from moemesh.models.partial_rope import permute_heads, permuted_rope
from moemesh.models.minimax_m2.config import rotary_dim


@dataclass(frozen=True)
class MiniMaxAttentionWeights:
    """qkv [(NH+2KVH)*D, H] (q rows, k rows, v rows), o [H, NH*D]; q_norm [NH*D], k_norm [KVH*D]."""

    qkv: Tensor
    o: Tensor
    q_norm: Tensor
    k_norm: Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float


class MiniMaxAttention:
    """Loads one layer's attention (q/k head dims permuted for the partial rope) and runs it."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, dense_dtype: str | None = None) -> None:
        self.cfg, self.dtype, self.dense_dtype = cfg, dtype, dense_dtype  # dense_dtype: qkv and o held in it
        rope = permuted_rope(cfg, rotary_dim(cfg))
        self.perm, self.rope = rope.perm, rope.table  # [D], [P, D]

    def load(self, reader: CheckpointReader, prefix: str) -> MiniMaxAttentionWeights:
        cfg, dt, perm = self.cfg, self.dtype, self.perm
        h, d, nh, kvh = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

        def get(name: str, shape: tuple[int, ...]) -> Tensor:
            return reader.get(f"{prefix}.{name}", shape=shape, dtype=dt)

        q = permute_heads(get("q_proj.weight", (nh * d, h)), nh, perm)
        k = permute_heads(get("k_proj.weight", (kvh * d, h)), kvh, perm)
        return MiniMaxAttentionWeights(
            qkv=matmul_layout(cat_rows([q, k, get("v_proj.weight", (kvh * d, h))]), dense_dtype=self.dense_dtype),
            o=matmul_layout(get("o_proj.weight", (h, nh * d)), dense_dtype=self.dense_dtype),
            q_norm=permute_heads(get("q_norm.weight", (nh * d,)), nh, perm),
            k_norm=permute_heads(get("k_norm.weight", (kvh * d,)), kvh, perm),
            num_heads=nh,
            num_kv_heads=kvh,
            head_dim=d,
            norm_eps=cfg.rms_norm_eps,
        )

    def __call__(self, x: Tensor, w: MiniMaxAttentionWeights, meta: BatchMeta, kv_pair: tuple[Tensor, Tensor]) -> Tensor:
        """x [T, H] -> [T, H]."""
        return minimax_attention(x, w, meta, self.rope, kv_pair[0], kv_pair[1])


def minimax_attention(
    x: Tensor, w: MiniMaxAttentionWeights, meta: BatchMeta, rope: RotaryTable, k_cache: Tensor, v_cache: Tensor
) -> Tensor:
    """x [T, H] -> [T, H]; rope: the full-width table of the permuted layout."""
    t = x.shape[0]
    nh, kvh, d = w.num_heads, w.num_kv_heads, w.head_dim
    qkv = linear(x, w.qkv)  # [T, (NH+2KVH)*D]
    q = rms_norm(qkv[:, : nh * d], w.q_norm, w.norm_eps).view(t, nh, d)  # norm over all heads at once
    k = rms_norm(qkv[:, nh * d : (nh + kvh) * d], w.k_norm, w.norm_eps).view(t, kvh, d)
    v = qkv[:, (nh + kvh) * d :].reshape(t, kvh, d)
    cos, sin_signed = rope_for_step(rope, meta.positions, x.dtype)  # [T, 1, D]
    q, k = apply_rope_signed(q, cos, sin_signed), apply_rope_signed(k, cos, sin_signed)
    out = paged_attention(q, k, v, meta, k_cache, v_cache)  # [T, NH, D]
    return linear(out.reshape(t, nh * d), w.o)
