"""Grouped-query attention over a paged KV cache.

Shape legend: T tokens, H hidden, NH query heads, KVH key/value heads, D head dim, B decoding
sequences, NB blocks per decoding sequence, BS block size, S = NB*BS cached positions, n chunk length.
KV cache of one layer: k, v [num_blocks, BS, KVH, D].
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.cpu import step_ops
from moemesh.models.batch import BatchMeta
from moemesh.models.layers import RotaryTable, linear, norm_rope, rope_for_step


@dataclass(frozen=True)
class AttentionWeights:
    """qkv [(NH+2KVH)*D, H] (q rows, k rows, v rows); o [H, NH*D] (plain, or as `matmul_layout` holds
    them: used through `layers.linear` only); optional per-head q/k RMSNorm [D]."""

    qkv: Tensor
    o: Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: Tensor | None = None
    q_norm: Tensor | None = None
    k_norm: Tensor | None = None
    norm_eps: float = 1e-6
    qk_norm: Tensor | None = field(init=False, default=None, repr=False)  # [NH+KVH, D] both norms at once

    def __post_init__(self) -> None:
        if self.q_norm is not None and self.k_norm is not None:
            d = self.head_dim
            joint = torch.cat([self.q_norm.expand(self.num_heads, d), self.k_norm.expand(self.num_kv_heads, d)])
            object.__setattr__(self, "qk_norm", joint)


def attention(
    x: Tensor,
    w: AttentionWeights,
    meta: BatchMeta,
    rope: RotaryTable,
    k_cache: Tensor,
    v_cache: Tensor,
    rope_cs: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """x [T, H] -> [T, H]: the q/k/v projection, per-head q/k RMSNorm and rope, then `paged_attention`.
    rope_cs: (cos, signed sin) from `rope_for_step`, to share across layers (computed here when None)."""
    t = x.shape[0]
    nh, kvh, d = w.num_heads, w.num_kv_heads, w.head_dim
    qkv = linear(x, w.qkv)  # [T, (NH+2KVH)*D]
    if w.qkv_bias is not None:
        qkv = qkv + w.qkv_bias
    heads = qkv.view(t, nh + 2 * kvh, d)  # [T, NH+2KVH, D]
    qk = heads[:, : nh + kvh]  # [T, NH+KVH, D]: queries and keys rotate together
    v = heads[:, nh + kvh :]  # [T, KVH, D]
    if w.qk_norm is None and (w.q_norm is not None or w.k_norm is not None):
        raise ValueError("q_norm and k_norm must be given together")
    cos, sin_signed = rope_cs if rope_cs is not None else rope_for_step(rope, meta.positions, x.dtype)
    qk = norm_rope(qk, w.qk_norm, w.norm_eps, cos, sin_signed)  # per-head norm (if any), then rope
    q, k = qk[:, :nh], qk[:, nh:]  # [T, NH, D], [T, KVH, D]
    out = paged_attention(q, k, v, meta, k_cache, v_cache)  # [T, NH, D]
    return linear(out.reshape(t, nh * d), w.o)  # [T, H]


def paged_attention(q: Tensor, k: Tensor, v: Tensor, meta: BatchMeta, k_cache: Tensor, v_cache: Tensor) -> Tensor:
    """The attention core shared by the families whose queries, keys and values are ordinary heads:
    q [T, NH, D], k / v [T, KVH, D] (rotated, normed) -> [T, NH, D]; writes this step's keys and values
    into the cache first (scale D^-0.5, causal, meta.sliding_window when set)."""
    t, nh, d = q.shape
    kvh = k.shape[1]
    if meta.num_decode == t and t and not meta.chunks:  # decode rows only: one compiled call where it runs
        out = step_ops.decode_attention(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.decode_block_tables, meta.decode_mask)
        if out is not None:
            return out
    k_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, v)

    b = meta.num_decode
    decoded = None
    if b:
        blocks = meta.decode_blocks  # [B*NB]
        kk = k_cache.index_select(0, blocks).view(b, -1, kvh, d).transpose(1, 2)  # [B, KVH, S, D]
        vv = v_cache.index_select(0, blocks).view(b, -1, kvh, d).transpose(1, 2)  # [B, KVH, S, D]
        # One query token per sequence: the NH/KVH query heads sharing a key/value head become that
        # head's "query rows" (head h reads kv head h // (NH/KVH), as transformers' repeat_kv does).
        qq = (q if b == t else q[:b]).reshape(b, kvh, nh // kvh, d)  # [B, KVH, NH/KVH, D]
        mask = meta.decode_bias(q.dtype)  # [B, 1, 1, S]
        decoded = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask)  # [B, KVH, NH/KVH, D]
        if not meta.chunks:
            return decoded.reshape(b, nh, d)
    out = torch.empty(t, nh, d, dtype=q.dtype)  # [T, NH, D]
    if decoded is not None:
        out[:b] = decoded.reshape(b, nh, d)
    # The chunks' SDPA calls take 4-D inputs (a batch of one): SDPA's fused kernels (the CPU flash
    # kernel included) take only those, and 3-D ones fall back to the math path, which copies K and V
    # once per query head and materializes every score, so a chunk after a long cached prefix (chunked
    # prefill, prefix cache hits) costs several times more.
    for c in meta.chunks:
        qq = q[c.start : c.start + c.length].transpose(0, 1)  # [NH, n, D]
        if c.start_pos > 0:  # after cached positions: attend over the sequence's blocks (this chunk's included)
            kk = k_cache.index_select(0, c.block_table).view(-1, kvh, d).transpose(0, 1)  # [KVH, S, D]
            vv = v_cache.index_select(0, c.block_table).view(-1, kvh, d).transpose(0, 1)  # [KVH, S, D]
            o = F.scaled_dot_product_attention(qq[None], kk[None], vv[None], attn_mask=c.mask, enable_gqa=True)[0]  # [NH, n, D]
        else:
            o = own_causal_attention(qq, k[c.start : c.start + c.length], v[c.start : c.start + c.length], meta.sliding_window)
        out[c.start : c.start + c.length] = o.transpose(0, 1)
    return out


def own_causal_attention(q: Tensor, k: Tensor, v: Tensor, window: int | None) -> Tensor:
    """A chunk at position 0 attends only to its own keys: q [NH, n, D], k/v [n, KVH, D] -> [NH, n, D]
    (4-D SDPA inputs, for its fused kernels: see paged_attention)."""
    n = k.shape[0]
    kk, vv = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, KVH, n, D]
    if window is None or n <= window:
        return F.scaled_dot_product_attention(q[None], kk, vv, is_causal=True, enable_gqa=True)[0]
    i = torch.arange(n)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)  # [n, n]
    return F.scaled_dot_product_attention(q[None], kk, vv, attn_mask=mask, enable_gqa=True)[0]
