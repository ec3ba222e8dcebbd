"""Paged KV cache: fixed-size blocks of token slots, handed out by a free-list allocator.

Shape legend: NBLK blocks, BS block size, KVH key/value heads, D head dim.
"""
from __future__ import annotations

import torch
from torch import Tensor


class BlockAllocator:
    """Hands out block ids in [0, num_blocks); `num_free` is observable for admission and tests."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class KVCache:
    """Per layer k, v [NBLK, BS, KVH, D] plus the allocator of their blocks."""

    def __init__(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.layers: list[tuple[Tensor, Tensor]] = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
