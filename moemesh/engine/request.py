"""One request's state inside the engine."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moemesh.block_hash import BlockHash
from moemesh.engine.sampling_params import SamplingParams


@dataclass(eq=False)
class Request:
    """Mutable per-request state owned by the engine (never shared across threads unguarded).

    num_computed: tokens whose keys/values are in this request's blocks (from the prefix cache or
    computed by its steps); the tokens after them run in the next steps, in chunks.
    block_hashes: keys of the first full blocks of `all_token_ids` (extended as needed; tokens are
    only appended, so they stay valid across preemption).
    num_registered: blocks of `block_table` already keyed in the prefix cache (or found there).
    cached_tokens: prompt tokens served from the prefix cache when the request first ran (None before).
    state_slot: its recurrent-state slot while it runs (models with linear-attention layers), else -1.
    prompt_logprobs: when asked for and not yet sent: [None, lp(p1|p0), ...] computed so far."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_registered: int = 0
    cached_tokens: int | None = None
    prompt_logprobs: list[float | None] | None = None
    finish_reason: str | None = None
    state_slot: int = -1

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prompt_logprobs_pending(self) -> bool:
        return self.prompt_logprobs is not None
