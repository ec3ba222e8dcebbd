"""One request's state inside the engine."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moemesh.engine.sampling_params import SamplingParams


@dataclass
class Request:
    """Mutable per-request state owned by the engine (never shared across threads unguarded).

    num_cached: tokens whose keys/values are in this request's blocks."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    prompt_logprobs_pending: bool = False
    finish_reason: str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)
