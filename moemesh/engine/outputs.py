"""What the engine hands back: one `StepOutput` per request per step, and whole `GenerationResult`s."""
from __future__ import annotations

from dataclasses import dataclass

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class StepOutput:
    """token_id / logprob: the token generated this step (None for an abort or an error);
    finish_reason: None while running, else "stop" | "length" | "abort" | "error";
    error: with "error", why this sequence failed alone (its batch mates went on): a ValueError
    when its own values are invalid, another exception (RuntimeError "logits: ...") otherwise;
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
    error: Exception | None = None


class StepFailed(RuntimeError):
    """A step whose model run failed as a whole: the sequences in its batch (`request_ids`) are
    removed and their KV blocks freed; waiting sequences and aborts are untouched. `cause` is what
    the model run raised (e.g. an expert server's error)."""

    def __init__(self, request_ids: tuple[str, ...], cause: BaseException) -> None:
        super().__init__(f"the engine step failed for {len(request_ids)} sequences: {cause}")
        self.request_ids = request_ids
        self.cause = cause


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    prompt_logprobs: list[float | None] | None = None
    cached_tokens: int = 0
