"""Grouped-query attention over a paged KV cache.

Shape legend: T tokens, H hidden, NH query heads, KVH key/value heads, D head dim, B decoding
sequences, NB blocks per decoding sequence, BS block size, S = NB*BS cached positions, n prefill length.
KV cache of one layer: k, v [num_blocks, BS, KVH, D].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from moemesh.models.batch import BatchMeta
from moemesh.models.layers import RotaryTable, apply_rope, rms_norm


@dataclass(frozen=True)
class AttentionWeights:
    """qkv [(NH+2KVH)*D, H] (q rows, k rows, v rows); o [H, NH*D]; optional per-head q/k RMSNorm [D]."""

    qkv: Tensor
    o: Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: Tensor | None = None
    q_norm: Tensor | None = None
    k_norm: Tensor | None = None
    norm_eps: float = 1e-6


def attention(
    x: Tensor, w: AttentionWeights, meta: BatchMeta, rope: RotaryTable, k_cache: Tensor, v_cache: Tensor
) -> Tensor:
    """x [T, H] -> [T, H]; writes this step's keys and values into the cache first."""
    t = x.shape[0]
    nh, kvh, d = w.num_heads, w.num_kv_heads, w.head_dim
    qkv = x @ w.qkv.t()  # [T, (NH+2KVH)*D]
    if w.qkv_bias is not None:
        qkv = qkv + w.qkv_bias
    q, k, v = qkv.split([nh * d, kvh * d, kvh * d], dim=-1)
    q = q.view(t, nh, d)
    k = k.view(t, kvh, d)
    v = v.reshape(t, kvh, d)
    if w.q_norm is not None:
        q = rms_norm(q, w.q_norm, w.norm_eps)
        k = rms_norm(k, w.k_norm, w.norm_eps)
    cos, sin = rope.for_positions(meta.positions, x.dtype)  # [T, 1, D]
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    k_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, v)

    out = torch.empty(t, nh, d, dtype=x.dtype)  # [T, NH, D]
    b = meta.num_decode
    if b:
        kk = k_cache[meta.decode_block_tables].view(b, -1, kvh, d).transpose(1, 2)  # [B, KVH, S, D]
        vv = v_cache[meta.decode_block_tables].view(b, -1, kvh, d).transpose(1, 2)  # [B, KVH, S, D]
        qq = q[:b].unsqueeze(2)  # [B, NH, 1, D]
        mask = meta.decode_mask[:, None, None, :]  # [B, 1, 1, S]
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True)  # [B, NH, 1, D]
        out[:b] = o.squeeze(2)
    for start, n in meta.prefills:
        qq = q[start : start + n].transpose(0, 1)  # [NH, n, D]
        kk = k[start : start + n].transpose(0, 1)  # [KVH, n, D]
        vv = v[start : start + n].transpose(0, 1)  # [KVH, n, D]
        if meta.sliding_window is None or n <= meta.sliding_window:
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)  # [NH, n, D]
        else:
            i = torch.arange(n)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - meta.sliding_window)  # [n, n]
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True)
        out[start : start + n] = o.transpose(0, 1)
    return out.view(t, nh * d) @ w.o.t()  # [T, H]
