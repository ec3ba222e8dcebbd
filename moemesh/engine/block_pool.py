"""`BlockPool`: the KV cache's blocks, shared by reference count, with the prefix cache's index.

Every block id in [0, num_blocks) is in one of three states:
  * in use: held by one or more sequences' block tables (ref count >= 1), keyed or not;
  * cached: held by no sequence but keyed by its `block_hash` (a full block of computed tokens):
    kept for a later request with the same prefix, and evicted least recently released first when a
    fresh block is needed;
  * free: held by nobody, keyed by nothing.
`num_free` counts free and cached blocks alike: both are available to a new sequence.

A block is keyed (`register`) once all its tokens are computed; its contents never change while it
is keyed (sequences write only to the blocks after their cached prefix). With caching off nothing
is keyed and the pool is a plain free list.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from moemesh.block_hash import BlockHash


class BlockPool:
    def __init__(self, num_blocks: int, caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.caching = caching
        self._ref = [0] * num_blocks
        self._key: list[BlockHash | None] = [None] * num_blocks
        self._by_key: dict[BlockHash, int] = {}
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: lowest ids handed out first
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref 0 and keyed, least recently released first

    @property
    def num_free(self) -> int:
        """Blocks a new sequence can get: free ones plus cached ones no sequence holds (evictable)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Keyed blocks, in use or not."""
        return len(self._by_key)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (a hash chain) found in the pool."""
        found: list[int] = []
        for h in hashes:
            block = self._by_key.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def acquire(self, blocks: Sequence[int]) -> None:
        """Adds a reference to each of `blocks` (cache hits): a cached one is no longer evictable."""
        for b in blocks:
            if self._ref[b] == 0:
                if b not in self._cached:
                    raise ValueError(f"block {b} is free: only blocks in use or cached can be shared")
                del self._cached[b]
            self._ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks (ref count 1): free ones first, then the least recently released cached ones
        (evicted: their keys are dropped)."""
        if n > self.num_free:
            raise ValueError(f"cannot allocate {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._cached.popitem(last=False)
                del self._by_key[self._key[b]]
                self._key[b] = None
            self._ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drops one reference to each of `blocks` (a sequence's table, in order). Blocks no one holds
        become cached (keyed) or free. The table's tail is released first, so a sequence's last blocks
        are evicted before its first ones (shared prefixes outlive their continuations)."""
        for b in reversed(blocks):
            if self._ref[b] < 1:
                raise ValueError(f"block {b} is not in use")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._key[b] is not None:
                    self._cached[b] = None
                else:
                    self._free.append(b)

    def register(self, block: int, key: BlockHash) -> bool:
        """Keys a full, computed block in use so later requests can share it. False (nothing changes) with
        caching off, or when another block already holds this key (two sequences computed the same
        prefix at once: the first stays the shared copy, this one is freed with its sequence)."""
        if not self.caching or key in self._by_key or self._key[block] is not None:
            return False
        if self._ref[block] < 1:
            raise ValueError(f"block {block} is not in use: only computed blocks of a sequence are keyed")
        self._key[block] = key
        self._by_key[key] = block
        return True
