"""Qwen3-Next / Qwen3.5 gated full attention: grouped-query attention whose output is multiplied by a
per-dim sigmoid gate (projected with the queries) before o_proj; zero-centred q/k RMSNorm per head;
rope on the first `rotary_dim` dims of each head. Runs on the engine's paged attention core.

Shape legend: T tokens, H hidden, NH query heads, KVH key/value heads, D head dim.

On disk q_proj [NH*2D, H] holds per head its D query rows then its D gate rows; they are split at
load. The partial rope runs as a full-width rope over permuted q/k head dims (models/partial_rope.py,
norm weights permuted alike); the gate and values keep their order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moemesh.checkpoint import CheckpointReader
from moemesh.config import ModelConfig
from moemesh.models.attention import paged_attention
from moemesh.models.batch import BatchMeta
from moemesh.models.partial_rope import permute_heads
from moemesh.models.layers import apply_rope_signed, linear, matmul_layout
from moemesh.models.qwen3_next.norms import scaled_rms_norm, zero_centered


@dataclass(frozen=True)
class GatedAttentionWeights:
    """qgkv [(2NH+2KVH)*D, H] (query rows, gate rows, key rows, value rows), o [H, NH*D];
    qk_norm [NH+KVH, D] float32 (the (1 + w) scales of q_norm then k_norm, one row per head)."""

    qgkv: Tensor
    o: Tensor
    qk_norm: Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float


def load_gated_attention(
    reader: CheckpointReader, prefix: str, cfg: ModelConfig, perm: Tensor, dtype: torch.dtype, dense_dtype: str | None = None
) -> GatedAttentionWeights:
    """perm [D]: the head-dim permutation of the partial rope; dense_dtype: qgkv and o held in it."""
    h, d, nh, kvh = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

    def get(name: str, shape: tuple[int, ...]) -> Tensor:
        return reader.get(f"{prefix}.{name}", shape=shape, dtype=dtype)

    q_gate = get("q_proj.weight", (nh * 2 * d, h)).view(nh, 2, d, h)
    q = permute_heads(q_gate[:, 0].reshape(nh * d, h), nh, perm)
    k = permute_heads(get("k_proj.weight", (kvh * d, h)), kvh, perm)
    qk_norm = torch.cat([
        zero_centered(get("q_norm.weight", (d,))[perm]).expand(nh, d),
        zero_centered(get("k_norm.weight", (d,))[perm]).expand(kvh, d),
    ])
    return GatedAttentionWeights(
        qgkv=matmul_layout(torch.cat([q, q_gate[:, 1].reshape(nh * d, h), k, get("v_proj.weight", (kvh * d, h))]),
                           dense_dtype=dense_dtype),
        o=matmul_layout(get("o_proj.weight", (h, nh * d)), dense_dtype=dense_dtype),
        qk_norm=qk_norm,
        num_heads=nh,
        num_kv_heads=kvh,
        head_dim=d,
        norm_eps=cfg.rms_norm_eps,
    )


def gated_attention(
    x: Tensor, w: GatedAttentionWeights, meta: BatchMeta, rope_cs: tuple[Tensor, Tensor], k_cache: Tensor, v_cache: Tensor
) -> Tensor:
    """x [T, H] -> [T, H]; rope_cs: (cos, signed sin) [T, 1, D] of the permuted full-width table."""
    t = x.shape[0]
    nh, kvh, d = w.num_heads, w.num_kv_heads, w.head_dim
    qgkv = linear(x, w.qgkv)  # [T, (2NH+2KVH)*D]
    gate = qgkv[:, nh * d : 2 * nh * d]  # [T, NH*D]
    qk = torch.cat([qgkv[:, : nh * d], qgkv[:, 2 * nh * d : (2 * nh + kvh) * d]], dim=-1).view(t, nh + kvh, d)
    qk = apply_rope_signed(scaled_rms_norm(qk, w.qk_norm, w.norm_eps), *rope_cs)  # [T, NH+KVH, D]
    v = qgkv[:, (2 * nh + kvh) * d :].reshape(t, kvh, d)
    out = paged_attention(qk[:, :nh], qk[:, nh:], v, meta, k_cache, v_cache)  # [T, NH, D]
    return linear(out.reshape(t, nh * d) * torch.sigmoid(gate), w.o)
