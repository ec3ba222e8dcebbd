"""Hash chain over full KV blocks: the key of a cached block is the hash of its parent block's key and
its own token ids, so equal keys mean equal token prefixes (up to a 128-bit hash collision).

Used by the engine's prefix cache (which blocks can be shared) and by the router (which replica has
seen a prompt's prefix). Pure Python, no torch: the router imports it too.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The key of a block holding `token_ids` after the blocks whose last key is `parent` (None: first block)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, limit: int | None = None) -> list[BlockHash]:
    """Appends to `hashes` (the keys of the first len(hashes) blocks of `token_ids`) the keys of the
    following full blocks, up to `limit` blocks in all (None: every full block). Returns `hashes`."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    full = len(token_ids) // block_size
    if limit is not None:
        full = min(full, limit)
    for i in range(len(hashes), full):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * block_size : (i + 1) * block_size]))
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, limit: int | None = None) -> list[BlockHash]:
    """The keys of the full blocks of `token_ids` (at most `limit` of them)."""
    return extend_hashes([], token_ids, block_size, limit)
