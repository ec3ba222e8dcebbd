"""`paged_attention` against a dense float64 reference, and its prompt chunks on SDPA's fused kernel.

Shape legend: NH query heads, KVH key/value heads, D head dim, BS block size, n a slice's tokens.
"""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from moemesh.models.attention import paged_attention
from moemesh.models.batch import BatchMeta, SeqSlice

NH, KVH, D, BS = 6, 2, 16, 4


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, s: SeqSlice, window: int | None) -> torch.Tensor:
    """q [n, NH, D] of slice `s` -> [n, NH, D]: each query over its sequence's cached keys up to its own
    position (and within `window`), in float64, read back from the cache the call wrote."""
    end = s.start_pos + len(s.token_ids)
    slots = torch.tensor([s.block_table[p // BS] * BS + p % BS for p in range(end)])
    k = k_cache.view(-1, KVH, D)[slots].double().repeat_interleave(NH // KVH, 1)  # [end, NH, D]
    v = v_cache.view(-1, KVH, D)[slots].double().repeat_interleave(NH // KVH, 1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, p in enumerate(range(s.start_pos, end)):
        lo = 0 if window is None else max(0, p - window + 1)
        scores = torch.einsum("hd,khd->hk", q[i].double(), k[lo : p + 1]) * D**-0.5  # [NH, keys]
        out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[lo : p + 1])
    return out


def run(slices: list[SeqSlice], window: int | None, num_blocks: int = 64):
    g = torch.Generator().manual_seed(0)
    meta = BatchMeta.build(slices, BS, window)
    t = meta.num_tokens
    q, k, v = (torch.randn(t, h, D, generator=g) for h in (NH, KVH, KVH))
    k_cache, v_cache = (torch.randn(num_blocks, BS, KVH, D, generator=g) for _ in range(2))  # earlier positions: random
    out = paged_attention(q, k, v, meta, k_cache, v_cache)
    return q, out, k_cache, v_cache, meta


SLICES = [
    SeqSlice([5], 9, list(range(0, 3))),  # a decode at position 9
    SeqSlice(list(range(7)), 0, list(range(3, 5))),  # a whole prompt
    SeqSlice(list(range(5)), 37, list(range(5, 16))),  # a chunk after 37 cached positions
    SeqSlice(list(range(3)), 2, list(range(16, 18))),  # a chunk after 2 (less than a block)
]


@pytest.mark.parametrize("window", [None, 3])
def test_decodes_whole_prompts_and_chunks_match_dense_attention(window):
    q, out, k_cache, v_cache, meta = run(SLICES, window)
    for s, r in zip(SLICES, (0, 1, 8, 13)):  # each slice's first row: the decode, then the others in order
        n = len(s.token_ids)
        torch.testing.assert_close(out[r : r + n].double(), reference(q[r : r + n], k_cache, v_cache, s, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 3])
def test_prompt_chunks_run_on_the_fused_kernel(window):
    """With SDPA restricted to its fused (flash) kernel, a chunk after cached positions and a whole
    prompt still run: their calls do not need the math fallback, which expands K/V per query head and
    materializes every score (several times slower for a chunk after a long prefix)."""
    chunks = SLICES[1:]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        q, out, k_cache, v_cache, meta = run(chunks, window)
    first = 0
    for s in chunks:
        n = len(s.token_ids)
        torch.testing.assert_close(out[first : first + n].double(), reference(q[first : first + n], k_cache, v_cache, s, window), atol=1e-5, rtol=1e-5)
        first += n
