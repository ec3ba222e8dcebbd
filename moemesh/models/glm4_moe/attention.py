"""GLM-4.5 MoE attention: grouped-query attention with optional per-head q/k RMSNorm, q/k/v bias and
partial rotary, served by the engine's standard paged attention (partial rope as a permuted
full-width rope, see partial_rope.py).

Shape legend: T tokens, H hidden, NH query heads, KVH key/value heads, D head dim.
"""
from __future__ import annotations

import torch
from torch import Tensor

from moemesh.checkpoint import CheckpointReader
from moemesh.config import ModelConfig
from moemesh.models.attention import AttentionWeights, attention
from moemesh.models.batch import BatchMeta
from moemesh.models.glm4_moe.config import rotary_dim
from moemesh.models.layers import cat_rows, matmul_layout
from moemesh.models.partial_rope import permute_heads, permuted_rope


class GlmAttention:
    """Loads one layer's attention weights (q/k dims permuted; with dense_dtype qkv and o held in that
    format, see `matmul_layout`) and runs them over the paged cache."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, dense_dtype: str | None = None) -> None:
        self.cfg, self.dtype, self.dense_dtype = cfg, dtype, dense_dtype
        rope = permuted_rope(cfg, rotary_dim(cfg))
        self.perm, self.rope = rope.perm, rope.table  # [D], [P, D]

    def load(self, reader: CheckpointReader, prefix: str) -> AttentionWeights:
        """q/k projection rows, biases and norm weights come back with each head's dims permuted."""
        cfg, dt, perm = self.cfg, self.dtype, self.perm
        h, d, nh, kvh = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

        def get(name: str, shape: tuple[int, ...]) -> Tensor:
            return reader.get(f"{prefix}.{name}", shape=shape, dtype=dt)

        qkv, o = self.load_projections(get, h, d, nh, kvh)
        bias = None
        if reader.has(f"{prefix}.q_proj.bias"):
            bias = torch.cat(
                [
                    permute_heads(get("q_proj.bias", (nh * d,)), nh, perm),
                    permute_heads(get("k_proj.bias", (kvh * d,)), kvh, perm),
                    get("v_proj.bias", (kvh * d,)),
                ]
            )
        return AttentionWeights(
            qkv=qkv,
            o=o,
            num_heads=nh,
            num_kv_heads=kvh,
            head_dim=d,
            qkv_bias=bias,
            q_norm=get("q_norm.weight", (d,))[perm] if cfg.qk_norm else None,
            k_norm=get("k_norm.weight", (d,))[perm] if cfg.qk_norm else None,
            norm_eps=cfg.rms_norm_eps,
        )

    def load_projections(self, get, h: int, d: int, nh: int, kvh: int):
        """(qkv [(NH+2KVH)*D, H] with q/k rows permuted per head, o [H, NH*D]): plain, or held in dense_dtype."""
        perm, fmt = self.perm, self.dense_dtype
        q = permute_heads(get("q_proj.weight", (nh * d, h)), nh, perm)
        k = permute_heads(get("k_proj.weight", (kvh * d, h)), kvh, perm)
        v = get("v_proj.weight", (kvh * d, h))
        qkv, o = cat_rows([q, k, v]), get("o_proj.weight", (h, nh * d))
        if fmt is None:
            return qkv, o
        return matmul_layout(qkv, dense_dtype=fmt), matmul_layout(o, dense_dtype=fmt)

    def __call__(self, h: Tensor, w: AttentionWeights, meta: BatchMeta, kv_pair: tuple[Tensor, Tensor]) -> Tensor:
        """h [T, H] -> [T, H]."""
        return attention(h, w, meta, self.rope, kv_pair[0], kv_pair[1])
