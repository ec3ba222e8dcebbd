"""What the engine hands back: one `StepOutput` per request per step, and whole `GenerationResult`s."""
from __future__ import annotations

from dataclasses import dataclass

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class StepOutput:
    """token_id / logprob: the token generated this step (None for an abort);
    finish_reason: None while running, else "stop" | "length" | "abort";
    prompt_logprobs: on a request's first output when asked for: [None, lp(p1|p0), ...];
    cached_tokens: on a request's first output: prompt tokens served from the prefix cache;
    top_logprobs: when asked for, the k most likely (token id, logprob) pairs at this position."""

    request_id: str
    token_id: int | None
    logprob: float | None
    finished: bool
    finish_reason: str | None = None
    prompt_logprobs: list[float | None] | None = None
    cached_tokens: int | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    prompt_logprobs: list[float | None] | None = None
    cached_tokens: int = 0
