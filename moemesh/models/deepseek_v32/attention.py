"""DSA attention (DeepSeek-V3.2, GLM-5): DeepSeek-V3's MLA over the latent cache (absorbed form for
decodes, expanded for prefills, moemesh.models.deepseek_v3.mla) restricted to the keys the lightning
indexer (indexer.py) selects for each query.

Shape legend: T tokens, H hidden, B decoding sequences, S cached positions per decoding sequence,
n prefill length, R kv_lora_rank, Dr rope dims, L = R + Dr, Di indexer head dim.

Cache slot of one token: [c_kv (R), k_pe (Dr), indexer key (Di)] in a `LatentCache` of width L + Di.
GLM-5's "shared" layers have no indexer: they write only the latent and reuse the selection the last
full layer made in this forward pass (the `DSAStep` handed from layer to layer).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from moemesh.models.batch import BatchMeta
from moemesh.models.deepseek_v3.mla import LatentCache, MLAWeights, latent_attention, mla_inputs, mla_output
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
    prefills: per prefill [n, n] bool, or None where the prefill keeps every causal key."""

    decode: Tensor | None
    prefills: tuple[Tensor | None, ...]


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
    x: Tensor, q_lat: Tensor, keys: Tensor, decode_keys: Tensor | None, w: IndexerWeights, meta: BatchMeta,
    step: DSAStep, cos: Tensor, sin: Tensor,
) -> Selection:
    """x [T, H], q_lat [T, Rq], this step's indexer keys [T, Di], the decodes' cached indexer keys
    decode_keys [B, S, Di] -> Selection (top-k per query; skipped where nothing exceeds index_topk)."""
    k = step.index_topk
    b = meta.num_decode
    need = [n > k for _, n in meta.prefills]
    if not step.decodes_select and not any(need):
        return Selection(None, (None,) * len(meta.prefills))
    q = index_queries(q_lat, w, cos, sin)  # [T, Hi, Di]
    hw = head_weights(x, w)  # [T, Hi]
    decode = None
    if step.decodes_select:
        decode = select_top_k(index_scores(q[:b], hw[:b], decode_keys, w), meta.decode_mask, k)  # [B, S]
    prefills: list[Tensor | None] = []
    for (start, n), selects in zip(meta.prefills, need):
        if not selects:
            prefills.append(None)
            continue
        sl = slice(start, start + n)
        causal = torch.ones(n, n, dtype=torch.bool).tril()  # [n, n]
        prefills.append(select_top_k(index_scores(q[sl], hw[sl], keys[sl], w), causal, k))
    return Selection(decode, tuple(prefills))


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
    if w.indexer is not None:
        decode_keys = lat[..., latent_dim:] if lat is not None else None
        step.selection = select_keys(x, inp.q_lat, keys, decode_keys, w.indexer, meta, step, cos, sin)
    elif step.selection is None:
        raise ValueError("indexer_types: a shared DSA layer needs a full indexer layer before it")
    sel = step.selection
    decode_mask = meta.decode_mask if sel.decode is None else sel.decode
    return mla_output(latent_attention(inp, w.mla, meta, lat, decode_mask, list(sel.prefills)), w.mla)
