"""gpt-oss attention: grouped-query attention with a learned per-head "sink" logit that joins every
softmax (and takes probability mass without contributing a value), biases on q/k/v/o, and a sliding
window on the layers that have one. Runs over the engine's paged KV cache.

Shape legend: T tokens, H hidden, NH query heads, KVH key/value heads, D head dim, B decoding
sequences, S cached positions per sequence, n chunk length, Q queries, L keys.
KV cache of one layer: k, v [num_blocks, BS, KVH, D].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moemesh.models.batch import BatchMeta
from moemesh.models.layers import RotaryTable, apply_rope, biased_linear


@dataclass(frozen=True)
class SinkAttentionWeights:
    """qkv [(NH+2KVH)*D, H] (q rows, k rows, v rows) + qkv_bias; o [H, NH*D] + o_bias [H] (plain, or held in
    dense_dtype by `matmul_layout`); sinks [NH];
    window: attend to the last `window` positions only (None = full causal)."""

    qkv: Tensor
    qkv_bias: Tensor | None
    o: Tensor
    o_bias: Tensor | None
    sinks: Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None


def attend_with_sinks(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, sinks: Tensor, scale: float) -> Tensor:
    """q [..., NH, Q, D], k/v [..., KVH, L, D], mask [..., 1, Q, L] (True = attend), sinks [NH]
    -> [..., NH, Q, D]. softmax over [scores, sink] per row, the sink's share dropped."""
    groups = q.shape[-3] // k.shape[-3]
    k = k.repeat_interleave(groups, dim=-3)  # [..., NH, L, D]
    v = v.repeat_interleave(groups, dim=-3)
    scores = (q @ k.transpose(-1, -2)) * scale  # [..., NH, Q, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype)[:, None, None].expand(*scores.shape[:-1], 1)  # [..., NH, Q, 1]
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # [..., NH, Q, L]
    return probs.to(v.dtype) @ v


def sink_attention(x: Tensor, w: SinkAttentionWeights, meta: BatchMeta, rope: RotaryTable, k_cache: Tensor, v_cache: Tensor) -> Tensor:
    """x [T, H] -> [T, H]; writes this step's keys and values into the cache first."""
    t = x.shape[0]
    nh, kvh, d = w.num_heads, w.num_kv_heads, w.head_dim
    scale = d**-0.5
    q, k, v = biased_linear(x, w.qkv, w.qkv_bias).split([nh * d, kvh * d, kvh * d], dim=-1)
    cos, sin = rope.for_positions(meta.positions, x.dtype)  # [T, 1, D]
    q = apply_rope(q.view(t, nh, d), cos, sin)
    k = apply_rope(k.view(t, kvh, d), cos, sin)
    v = v.reshape(t, kvh, d)
    k_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, v)

    out = torch.empty(t, nh, d, dtype=x.dtype)  # [T, NH, D]
    b = meta.num_decode
    if b:
        kk = k_cache[meta.decode_block_tables].view(b, -1, kvh, d).transpose(1, 2)  # [B, KVH, S, D]
        vv = v_cache[meta.decode_block_tables].view(b, -1, kvh, d).transpose(1, 2)
        mask = meta.decode_mask  # [B, S] causal
        if w.window is not None:
            kv_pos = torch.arange(mask.shape[1])
            mask = mask & (kv_pos[None, :] > meta.positions[:b, None] - w.window)
        o = attend_with_sinks(q[:b].unsqueeze(2), kk, vv, mask[:, None, None, :], w.sinks, scale)  # [B, NH, 1, D]
        out[:b] = o.squeeze(2)
    for c in meta.chunks:
        rows = slice(c.start, c.start + c.length)
        qq = q[rows].transpose(0, 1)  # [NH, n, D]
        if c.start_pos > 0:  # after cached positions: attend over the sequence's blocks (this chunk's included)
            kk = k_cache[c.block_table].view(-1, kvh, d).transpose(0, 1)  # [KVH, S, D]
            vv = v_cache[c.block_table].view(-1, kvh, d).transpose(0, 1)
            mask = c.mask if w.window is None else c.window_mask(w.window)  # [n, S]
        else:
            kk, vv = k[rows].transpose(0, 1), v[rows].transpose(0, 1)  # [KVH, n, D]
            i = torch.arange(c.length)
            mask = i[None, :] <= i[:, None]  # [n, n]
            if w.window is not None:
                mask &= i[None, :] > i[:, None] - w.window
        out[rows] = attend_with_sinks(qq, kk, vv, mask[None], w.sinks, scale).transpose(0, 1)
    return biased_linear(out.view(t, nh * d), w.o, w.o_bias)  # [T, H]
