"""Paged KV cache: fixed-size blocks of token slots per layer, handed out by a `BlockPool`.

Shape legend: NBLK blocks, BS block size, KVH key/value heads, D head dim.
"""
from __future__ import annotations

from typing import Collection

import torch
from torch import Tensor

from moemesh.engine.block_pool import BlockPool


class KVCache:
    """Per layer k, v [NBLK, BS, KVH, D] plus the pool of their blocks (`prefix_caching`: keep
    computed full blocks for later requests with the same prefix). `skip_layers`: layers without
    keys and values (linear-attention layers keep a recurrent state instead); their entry is None."""

    def __init__(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        device: torch.device | str = "cpu", prefix_caching: bool = True, skip_layers: Collection[int] = (),
    ):
        self.block_size = block_size
        self.allocator = BlockPool(num_blocks, caching=prefix_caching)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.layers: list[tuple[Tensor, Tensor] | None] = [
            None if layer in skip_layers
            else (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for layer in range(num_layers)
        ]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
