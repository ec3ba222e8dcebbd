"""The router's domain objects: what a client asks for, what goes to an attention replica, what
comes back. Proto messages are translated to and from these at the edges (servicer, client)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling as the client set it; None = the model's default."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    prompt_logprobs: bool = False
    ignore_eos: bool = False


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str


@dataclass(frozen=True)
class GenerationInput:
    """One client request: exactly one of `prompt`, `prompt_token_ids`, `messages` is set."""

    request_id: str = ""
    model: str = ""
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatTurn, ...] | None = None
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class SequenceSpec:
    """What an attention replica runs: token ids and sampling, already validated."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec


@dataclass(frozen=True)
class SequenceUpdate:
    """One message from an attention replica (one engine step that produced tokens)."""

    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    finish_reason: str = ""
    prompt_logprobs: tuple[float | None, ...] = ()
    cached_tokens: int | None = None  # on the first update: prompt tokens served from the prefix cache


@dataclass(frozen=True)
class Delta:
    """New output for the client: text since the last delta and the tokens that produced it."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class Finished:
    """The end of a stream."""

    finish_reason: str
    prompt_token_ids: tuple[int, ...]
    completion_tokens: int
    prompt_logprobs: tuple[float | None, ...] = ()
    cached_tokens: int = 0
