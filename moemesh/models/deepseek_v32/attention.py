"""DSA attention (DeepSeek-V3.2, GLM-5): DeepSeek-V3's MLA over the latent cache (absorbed form for
decodes, expanded for chunks, moemesh.models.deepseek_v3.mla) restricted to the keys the lightning
indexer (indexer.py) selects for each query.

Shape legend: T tokens, H hidden, B decoding sequences, S cached positions per sequence, n chunk
length, R kv_lora_rank, Dr rope dims, L = R + Dr, Di indexer head dim.

A chunk after cached positions (prefix cache hit, chunked prefill) scores the indexer keys of its
sequence's blocks, the cached ones and its own (written first), under the chunk's causal mask; a
chunk at position 0 scores its own keys only.

Cache slot of one token: [c_kv (R), k_pe (Dr), indexer key (Di)] in a `LatentCache` of width L + Di.
GLM-5's "shared" layers have no indexer: they write only the latent and reuse the selection the last
full layer made in this forward pass (the `DSAStep` handed from layer to layer).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from moemesh.models.batch import BatchMeta
from moemesh.models.deepseek_v3.mla import (
    LatentCache, MLAWeights, chunk_latents, latent_attention, mla_inputs, mla_output,
)
from moemesh.models.deepseek_v32.indexer import (
    IndexerWeights, head_weights, index_keys, index_queries, index_scores, select_top_k,
)
from moemesh.models.layers import RotaryTable


@dataclass(frozen=True)
class DSAWeights:
    """mla: the layer's MLA; indexer: None on a layer that reuses the previous layer's selection."""

    mla: MLAWeights
    indexer: IndexerWeights | None


@dataclass(frozen=True)
class Selection:
    """The keys each query attends to. decode [B, S] bool (None: every key the decode mask allows);
    chunks: per chunk [n, S] bool (or [n, n] for a chunk at position 0), or None where the chunk keeps
    every causal key."""

    decode: Tensor | None
    chunks: tuple[Tensor | None, ...]


@dataclass
class DSAStep:
    """One forward pass's DSA state: index_topk, whether any decode sees more than index_topk keys
    (else no decode needs scoring), and the selection of the last full indexer layer."""

    index_topk: int
    decodes_select: bool
    selection: Selection | None = field(default=None)

    @classmethod
    def begin(cls, meta: BatchMeta, index_topk: int) -> "DSAStep":
        b = meta.num_decode
        longest = int(meta.positions[:b].max()) + 1 if b else 0  # keys the longest decode sees
        return cls(index_topk, longest > index_topk)


def select_keys(
    x: Tensor, q_lat: Tensor, keys: Tensor, decode_keys: Tensor | None, chunk_keys: list[Tensor | None],
    w: IndexerWeights, meta: BatchMeta, step: DSAStep, cos: Tensor, sin: Tensor,
) -> Selection:
    """x [T, H], q_lat [T, Rq], this step's indexer keys [T, Di], the decodes' cached indexer keys
    decode_keys [B, S, Di], per chunk its sequence's indexer keys [S, Di] (None for a chunk at position
    0) -> Selection (top-k per query; skipped where no query sees more than index_topk keys)."""
    k = step.index_topk
    b = meta.num_decode
    need = [c.start_pos + c.length > k for c in meta.chunks]  # the chunk's last query sees start_pos + n keys
    if not step.decodes_select and not any(need):
        return Selection(None, (None,) * len(meta.chunks))
    q = index_queries(q_lat, w, cos, sin)  # [T, Hi, Di]
    hw = head_weights(x, w)  # [T, Hi]
    decode = None
    if step.decodes_select:
        decode = select_top_k(index_scores(q[:b], hw[:b], decode_keys, w), meta.decode_mask, k)  # [B, S]
    chunks: list[Tensor | None] = []
    for c, cached, selects in zip(meta.chunks, chunk_keys, need):
        if not selects:
            chunks.append(None)
            continue
        sl = slice(c.start, c.start + c.length)
        if cached is None:  # at position 0: its own keys, causal
            seen, visible = keys[sl], torch.ones(c.length, c.length, dtype=torch.bool).tril()  # [n, n]
        else:
            seen, visible = cached, c.mask  # [S, Di], [n, S]
        chunks.append(select_top_k(index_scores(q[sl], hw[sl], seen, w), visible, k))
    return Selection(decode, tuple(chunks))


def dsa_attention(x: Tensor, w: DSAWeights, meta: BatchMeta, rope: RotaryTable, cache: LatentCache, step: DSAStep) -> Tensor:
    """x [T, H] -> [T, H]; writes this step's latents (and indexer keys) into the cache first, and on a
    full indexer layer records its selection in `step` for the shared layers after it."""
    cos, sin = rope.for_positions(meta.positions, x.dtype)  # [T, 1, Dr]
    inp = mla_inputs(x, w.mla, cos, sin)
    latent_dim = w.mla.latent_dim
    keys = None
    if w.indexer is not None:
        keys = index_keys(x, w.indexer, cos, sin)  # [T, Di]
        cache.write(meta.slot_mapping, torch.cat([inp.latent, keys], dim=-1))
    else:
        cache.write(meta.slot_mapping, inp.latent)
    lat = cache.gather(meta.decode_block_tables) if meta.num_decode else None  # [B, S, L+Di]
    chunk_lat = chunk_latents(cache, meta)  # per chunk [S, L+Di] or None
    if w.indexer is not None:
        decode_keys = lat[..., latent_dim:] if lat is not None else None
        chunk_keys = [None if c is None else c[:, latent_dim:] for c in chunk_lat]
        step.selection = select_keys(x, inp.q_lat, keys, decode_keys, chunk_keys, w.indexer, meta, step, cos, sin)
    elif step.selection is None:
        raise ValueError("indexer_types: a shared DSA layer needs a full indexer layer before it")
    sel = step.selection
    decode_mask = meta.decode_mask if sel.decode is None else sel.decode
    masks = [c.mask if m is None else m for c, m in zip(meta.chunks, sel.chunks)]
    return mla_output(latent_attention(inp, w.mla, meta, lat, decode_mask, chunk_lat, masks), w.mla)
