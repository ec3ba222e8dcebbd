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
    top_logprobs: int = 0


@dataclass(frozen=True)
class ToolCallSpec:
    """A tool call of an earlier assistant turn; `arguments` is a JSON object in text form."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolSpec:
    """A tool the chat template presents; `parameters` is a JSON Schema in text form ("" = none)."""

    name: str
    description: str = ""
    parameters: str = ""


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str
    tool_calls: tuple[ToolCallSpec, ...] = ()
    tool_call_id: str = ""
    name: str = ""
    reasoning_content: str = ""


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
    tools: tuple[ToolSpec, ...] = ()
    chat_template_kwargs: tuple[tuple[str, str], ...] = ()  # (name, JSON value in text form)
    fill_context: bool = False  # max_new_tokens unset: up to the context, not the model's default
    continue_final_message: bool = False  # chat: go on from the last (assistant) message's text


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
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()  # per token: (id, logprob), most likely first
    cached_tokens: int | None = None  # on the first update: prompt tokens served from the prefix cache


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str  # the token's text decoded alone
    logprob: float


@dataclass(frozen=True)
class Delta:
    """New output for the client: text since the last delta and the tokens that produced it.
    `tokens` (each token's own text) and `top_logprobs` are filled when the client asked for
    logprobs; `prompt_tokens` is set on the first delta that carries tokens."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] = ()
    tokens: tuple[str, ...] = ()
    top_logprobs: tuple[tuple[TokenLogprob, ...], ...] = ()
    prompt_tokens: int | None = None
    completion_tokens: int = 0  # tokens generated so far, this delta's included
    cached_tokens: int = 0  # with prompt_tokens: those served from the prefix cache


@dataclass(frozen=True)
class Finished:
    """The end of a stream."""

    finish_reason: str
    prompt_token_ids: tuple[int, ...]
    completion_tokens: int
    prompt_logprobs: tuple[float | None, ...] = ()
    stop_string: str = ""  # the stop string that ended the stream, if one did
    cached_tokens: int = 0
