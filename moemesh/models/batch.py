"""Per-batch metadata the engine hands to a model forward (built once per step, shared by all layers).

Shape legend: T tokens in the batch, B decoding sequences, S cached positions gathered per decoding
sequence (blocks x block size), NB blocks per decoding sequence (padded).
Token layout: the B decode tokens first (one per sequence), then each prefill's tokens in order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's share of a step.

    token_ids    tokens to run this step (1 for a decode, the whole sequence for a prefill)
    start_pos    position of token_ids[0] (0 for a prefill, the cached length for a decode)
    block_table  KV cache blocks of this sequence, covering start_pos + len(token_ids) positions
    all_logits   return logits for every token (prompt logprobs), not only the last
    state_slot   the sequence's recurrent-state slot (models with linear-attention layers), else -1
    """

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    all_logits: bool = False
    state_slot: int = -1

    @property
    def is_decode(self) -> bool:
        return self.start_pos > 0


@dataclass(frozen=True)
class BatchMeta:
    """input_ids [T], positions [T], slot_mapping [T] (flat KV slot per token);
    decode_block_tables [B, NB], decode_mask [B, S] (True = attend); prefills ((start, length), ...);
    logits_idx [R] rows of T whose logits are computed; logits_rows: per input SeqSlice, its (start, n) in R;
    state_slots [N] each sequence's recurrent-state slot, in token-layout order (decodes, then prefills)."""

    input_ids: Tensor
    positions: Tensor
    slot_mapping: Tensor
    num_decode: int
    decode_block_tables: Tensor
    decode_mask: Tensor
    prefills: tuple[tuple[int, int], ...]
    logits_idx: Tensor
    logits_rows: tuple[tuple[int, int], ...]
    sliding_window: int | None
    state_slots: Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(cls, seqs: Sequence[SeqSlice], block_size: int, sliding_window: int | None = None) -> "BatchMeta":
        """seqs in any order; decodes must come first (the engine schedules them so)."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        decodes = [s for s in seqs if s.is_decode]
        if any(s.is_decode for s in seqs[len(decodes):]):
            raise ValueError("seqs: decoding sequences must come before prefills")
        prefills = []
        logits_idx: list[int] = []
        logits_rows = []
        for s in seqs:
            n = len(s.token_ids)
            if s.is_decode and n != 1:
                raise ValueError(f"seqs: a continuing sequence runs one token per step, got {n}")
            start = len(ids)
            if not s.is_decode:
                prefills.append((start, n))
            ids.extend(int(t) for t in s.token_ids)
            for p in range(s.start_pos, s.start_pos + n):
                slots.append(s.block_table[p // block_size] * block_size + p % block_size)
                pos.append(p)
            first = len(logits_idx)
            logits_idx.extend(range(start, start + n) if s.all_logits else [start + n - 1])
            logits_rows.append((first, len(logits_idx) - first))
        num_blocks = max((len(s.block_table) for s in decodes), default=0)
        tables = torch.zeros(len(decodes), num_blocks, dtype=torch.long)  # [B, NB]
        for b, s in enumerate(decodes):
            tables[b, : len(s.block_table)] = torch.tensor(list(s.block_table), dtype=torch.long)
        kv_pos = torch.arange(num_blocks * block_size)  # [S]
        q_pos = torch.tensor([s.start_pos for s in decodes], dtype=torch.long)[:, None]  # [B, 1]
        mask = kv_pos[None, :] <= q_pos  # [B, S]
        if sliding_window is not None:
            mask &= kv_pos[None, :] > q_pos - sliding_window
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.tensor(pos, dtype=torch.long),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            num_decode=len(decodes),
            decode_block_tables=tables,
            decode_mask=mask,
            prefills=tuple(prefills),
            logits_idx=torch.tensor(logits_idx, dtype=torch.long),
            logits_rows=tuple(logits_rows),
            sliding_window=sliding_window,
            state_slots=torch.tensor([s.state_slot for s in seqs], dtype=torch.long),
        )
