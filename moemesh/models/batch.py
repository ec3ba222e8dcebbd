"""Per-batch metadata the engine hands to a model forward (built once per step, shared by all layers).

Shape legend: T tokens in the batch, B decoding sequences, S cached positions gathered per sequence
(blocks x block size), NB blocks per decoding sequence (padded), NBc blocks of one chunk's sequence,
n tokens of one chunk, R logits rows.

A step runs, per sequence, a slice of its tokens at positions [start_pos, start_pos + n):
  * a *decode*: one token after cached ones (start_pos > 0, n = 1): one query over the cache;
  * a *chunk*: any other slice: a whole prompt (start_pos 0), or a part of one after a cached prefix
    (prefix cache hit) or after earlier chunks (chunked prefill). Its queries attend causally to the
    cached positions [0, start_pos) and to its own tokens.
Token layout: the B decode tokens first (one per sequence), then each chunk's tokens in order; the
slices may be given in any order (`logits_rows` follows the given order).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch
from torch import Tensor

LOGITS = ("last", "all", "none")


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's share of a step.

    token_ids    tokens to run this step
    start_pos    position of token_ids[0] (the number of positions already in the cache)
    block_table  KV cache blocks of this sequence, covering at least start_pos + len(token_ids) positions
    logits       which rows get logits: "last" (to sample), "all" (prompt logprobs) or "none" (a chunk
                 that does not end the prompt)
    state_slot   the sequence's recurrent-state slot (models with linear-attention layers), else -1
    """

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    logits: str = "last"
    state_slot: int = -1

    def __post_init__(self) -> None:
        if self.logits not in LOGITS:
            raise ValueError(f"logits must be one of {LOGITS}, got {self.logits!r}")
        if not self.token_ids:
            raise ValueError("token_ids: a slice runs at least one token")
        if self.start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {self.start_pos}")

    @property
    def is_decode(self) -> bool:
        return self.start_pos > 0 and len(self.token_ids) == 1


@dataclass(frozen=True)
class ChunkMeta:
    """One chunk's rows [start, start + length) of T, at positions [start_pos, start_pos + length).

    For start_pos > 0: block_table [NBc] (the blocks holding positions [0, start_pos + length)) and
    mask [n, S] (True = attend: causal, and within the batch's sliding window if any), S = NBc x BS.
    For start_pos == 0 both are None: the chunk attends only to its own keys (causal)."""

    start: int
    length: int
    start_pos: int
    block_table: Tensor | None
    mask: Tensor | None

    def window_mask(self, window: int) -> Tensor:
        """mask [n, S] for a layer with its own sliding window (gpt-oss): causal and within `window`."""
        q_pos = torch.arange(self.start_pos, self.start_pos + self.length)[:, None]  # [n, 1]
        return causal_mask(q_pos, self.mask.shape[1], window)


@dataclass(frozen=True)
class BatchMeta:
    """input_ids [T], positions [T], slot_mapping [T] (flat KV slot per token);
    decode_block_tables [B, NB], decode_mask [B, S] (True = attend); chunks: the other slices;
    logits_idx [R] rows of T whose logits are computed; logits_rows: per input SeqSlice, its (start, n) in R;
    state_slots [N] each slice's recurrent-state slot, in token-layout order (decodes, then chunks);
    logits_every_row: logits_idx is every row of T in order (a decode step's), so x[logits_idx] is x."""

    input_ids: Tensor
    positions: Tensor
    slot_mapping: Tensor
    num_decode: int
    decode_block_tables: Tensor
    decode_mask: Tensor
    chunks: tuple[ChunkMeta, ...]
    logits_idx: Tensor
    logits_rows: tuple[tuple[int, int], ...]
    sliding_window: int | None
    block_size: int
    state_slots: Tensor
    logits_every_row: bool

    def logits_rows_of(self, x: Tensor) -> Tensor:
        """x [T, ...] -> its rows logits_idx [R, ...] (x itself where they are every row in order)."""
        return x if self.logits_every_row else x[self.logits_idx]

    # Per-step views every layer's decode attention reads, made once per step (not once per layer).
    @cached_property
    def decode_blocks(self) -> Tensor:
        """decode_block_tables flattened: [B*NB]."""
        return self.decode_block_tables.view(-1)

    def decode_bias(self, dtype: torch.dtype) -> Tensor:
        """decode_mask as the additive bias SDPA makes of a boolean mask, [B, 1, 1, S] in dtype (0 where
        attended, -inf elsewhere; broadcast over heads and query rows): made once per step and dtype
        rather than inside every layer's SDPA call (same values, so the same attention)."""
        made = self.__dict__.setdefault("_decode_bias", {})
        if dtype not in made:
            mask = self.decode_mask[:, None, None, :]  # [B, 1, 1, S]
            made[dtype] = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        return made[dtype]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(cls, seqs: Sequence[SeqSlice], block_size: int, sliding_window: int | None = None) -> "BatchMeta":
        """seqs in any order: decodes are laid out first."""
        order = [i for i, s in enumerate(seqs) if s.is_decode] + [i for i, s in enumerate(seqs) if not s.is_decode]
        decodes = [seqs[i] for i in order if seqs[i].is_decode]
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        row_of: dict[int, int] = {}  # input index -> first row in T
        chunks: list[ChunkMeta] = []
        for i in order:
            s = seqs[i]
            n = len(s.token_ids)
            end = s.start_pos + n
            if len(s.block_table) * block_size < end:
                raise ValueError(f"block_table: {len(s.block_table)} blocks of {block_size} cannot hold {end} positions")
            row_of[i] = len(ids)
            if not s.is_decode:
                chunks.append(_chunk(len(ids), s, block_size, sliding_window))
            ids.extend(int(t) for t in s.token_ids)
            for p in range(s.start_pos, end):
                slots.append(s.block_table[p // block_size] * block_size + p % block_size)
                pos.append(p)
        logits_idx: list[int] = []
        logits_rows = []
        for i, s in enumerate(seqs):
            first, start, n = len(logits_idx), row_of[i], len(s.token_ids)
            if s.logits == "all":
                logits_idx.extend(range(start, start + n))
            elif s.logits == "last":
                logits_idx.append(start + n - 1)
            logits_rows.append((first, len(logits_idx) - first))
        num_blocks = max((len(s.block_table) for s in decodes), default=0)
        padded = [list(s.block_table) + [0] * (num_blocks - len(s.block_table)) for s in decodes]
        tables = torch.tensor(padded, dtype=torch.long).view(len(decodes), num_blocks)  # [B, NB], zero-padded
        q_pos = torch.tensor([s.start_pos for s in decodes], dtype=torch.long)[:, None]  # [B, 1]
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.tensor(pos, dtype=torch.long),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            num_decode=len(decodes),
            decode_block_tables=tables,
            decode_mask=causal_mask(q_pos, num_blocks * block_size, sliding_window),
            chunks=tuple(chunks),
            logits_idx=torch.tensor(logits_idx, dtype=torch.long),
            logits_rows=tuple(logits_rows),
            sliding_window=sliding_window,
            block_size=block_size,
            state_slots=torch.tensor([seqs[i].state_slot for i in order], dtype=torch.long),
            logits_every_row=len(logits_idx) == len(ids) and logits_idx == list(range(len(ids))),
        )


def causal_mask(q_pos: Tensor, num_kv: int, window: int | None) -> Tensor:
    """q_pos [Q, 1] query positions -> [Q, num_kv] (True = attend): key positions <= the query's, and
    within the last `window` positions when a window is given."""
    kv_pos = torch.arange(num_kv)[None, :]  # [1, S]
    mask = kv_pos <= q_pos
    if window is not None:
        mask &= kv_pos > q_pos - window
    return mask


def _chunk(start: int, s: SeqSlice, block_size: int, window: int | None) -> ChunkMeta:
    n = len(s.token_ids)
    if s.start_pos == 0:
        return ChunkMeta(start, n, 0, None, None)
    num_blocks = -(-(s.start_pos + n) // block_size)
    table = torch.tensor(list(s.block_table[:num_blocks]), dtype=torch.long)  # [NBc]
    q_pos = torch.arange(s.start_pos, s.start_pos + n)[:, None]  # [n, 1]
    return ChunkMeta(start, n, s.start_pos, table, causal_mask(q_pos, num_blocks * block_size, window))
