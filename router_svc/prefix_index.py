"""`PrefixIndex`: the prompt prefixes a router recently sent to one attention replica, as the keys of
their full KV blocks (`moemesh.block_hash`, with the replicas' block size).

It stands in for what the replica's prefix cache holds (SGLang's cache-aware router keeps an
approximate radix tree per worker the same way): `match` says how many leading blocks of a new
prompt the replica has most likely cached. It remembers at most `capacity` keys (the replica's KV
cache size in blocks, from its load reports) and forgets the least recently used first; a prompt's
keys are touched last to first, so a prefix outlives its continuations, as in the replica's cache.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from moemesh.block_hash import BlockHash

DEFAULT_CAPACITY = 4096  # blocks, until the replica reports its KV cache size


class PrefixIndex:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[BlockHash, None] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `hashes` (a prompt's key chain) were sent here."""
        n = 0
        for h in hashes:
            if h not in self._keys:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[BlockHash]) -> None:
        """Records a prompt sent here (its key chain); forgets the least recently used beyond capacity."""
        for h in reversed(hashes):
            self._keys[h] = None
            self._keys.move_to_end(h)
        while len(self._keys) > max(self.capacity, 0):
            self._keys.popitem(last=False)
