"""Dequantization by table lookup: every stored byte, together with the scale that applies to it, keys
one entry of a small table of finished values, so a whole projection is widened by one gather.

A format builds `table [R, 256, W]` in the output dtype (R scale keys, 256 byte values, W values per
byte: 2 for packed E2M1, 1 for float8), each entry computed with exactly the arithmetic its
`dequantize` documents, and an index `key << 8 | byte` (int32) per stored byte. Tables hold only the
scale keys present (the span of the stored scale bytes), so they stay small and cache resident.

Shape legend: R scale keys, W values per byte, ... any leading dims of the stored bytes.
"""
from __future__ import annotations

import torch
from torch import Tensor

_WORDS = {4: torch.int32, 8: torch.int64}  # bytes of one table entry -> the integer that holds it


def byte_span(t: Tensor) -> tuple[int, int]:
    """Smallest and largest byte of a uint8 (or 8-bit float) tensor; (0, 0) when empty."""
    if t.numel() == 0:
        return 0, 0
    lo, hi = torch.aminmax(t.view(torch.uint8))
    return int(lo), int(hi)


def lookup(table: Tensor, index: Tensor) -> Tensor:
    """table [R, 256, W] (any dtype); index [...] int32 in [0, R * 256) -> values [..., W] in table.dtype.

    A gather over a flat table is torch's fast index_select path: W == 1 gathers values, an entry of
    4 or 8 bytes is gathered as one integer word, other entries row by row (the slow generic path)."""
    r, b, w = table.shape
    flat = table.reshape(r * b, w)
    word = table.dtype if w == 1 else _WORDS.get(w * table.element_size())
    if word is None:
        return flat.index_select(0, index.reshape(-1)).reshape(*index.shape, w)
    out = flat.view(word).reshape(-1).index_select(0, index.reshape(-1))  # [numel] words
    return out.view(table.dtype).reshape(*index.shape, w)


def keyed_index(stored: Tensor, key: Tensor) -> Tensor:
    """stored [...] uint8 (or 8-bit float) bytes; key int32 broadcastable to stored -> (key << 8) | byte, int32."""
    out = torch.empty(stored.shape, dtype=torch.int32, device=stored.device)
    return torch.bitwise_or(stored.view(torch.uint8), key << 8, out=out)
