"""The router's domain objects: what a client asks for, what goes to an attention replica, what
comes back. Proto messages are translated to and from these at the edges (servicer, client)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling as the client set it; None = the model's default."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()  # a tuple once prepared
    logprobs: bool = False
    prompt_logprobs: bool = False
    ignore_eos: bool = False


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str


@dataclass(frozen=True)
class GenerationInput:
    """One client request: exactly one of `prompt`, `prompt_token_ids`, `messages` is set. The
    sequences may be a parsed message's repeated fields (not copied): `RequestPreparer` checks their
    sizes before it converts them."""

    request_id: str = ""
    model: str = ""
    prompt: str | None = None
    prompt_token_ids: Sequence[int] | None = None
    messages: Sequence[ChatTurn] | None = None  # or ChatMessage protos (role, content)
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    stop: Sequence[str] = ()


@dataclass(frozen=True)
class SequenceSpec:
    """What an attention replica runs: token ids and sampling, already validated. `sequence_id` is
    the replica's name for it: the client's id made unique by the router, so that ids of clients of
    different routers, or an id reused right after a cancel, never collide on a replica."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec
    sequence_id: str = ""


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
