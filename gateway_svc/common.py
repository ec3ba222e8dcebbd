"""What the OpenAI and Anthropic APIs share: ids, the model name check, template kwargs, the
sampling fields, and collecting a whole generation for a non-streaming answer."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from gateway_svc.body import Fields
from gateway_svc.errors import ApiError, bad_request
from gateway_svc.parsing import Content, OutputParser, Reasoning, ToolCall


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def check_model(f: Fields, served: str) -> str:
    """The request's `model` (absent = the served one); 404 for any other name."""
    model = f.str("model", default="")
    if model and model != served:
        raise ApiError(404, f"model: the model {model!r} does not exist; this server serves {served!r}", "model", "model_not_found")
    return served


def template_kwargs(f: Fields, key: str = "chat_template_kwargs") -> dict[str, str]:
    """`chat_template_kwargs` (an object) as the router takes it: each value in JSON text form."""
    sub = f.sub(key)
    return {name: json.dumps(value) for name, value in sub.obj.items()}


def stop_strings(f: Fields, key: str) -> list[str]:
    """`stop` as a string or an array of strings."""
    value = f.raw(key)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise bad_request(f"{f.name(key)}: must be a string or an array of strings", f.name(key))


def set_sampling(req, f: Fields, max_tokens: int | None) -> None:
    """temperature, top_p, top_k, seed and the length onto a GenerateRequest (unset stays unset)."""
    if max_tokens is not None:
        req.max_new_tokens = max_tokens
    else:
        req.fill_context = True
    for key in ("temperature", "top_p"):
        value = f.number(key)
        if value is not None:
            setattr(req, key, value)
    top_k = f.int("top_k")
    if top_k is not None and top_k != -1:  # -1 means off in vLLM's API
        req.top_k = top_k
    seed = f.int("seed")
    if seed is not None:
        req.seed = seed
    if f.bool("ignore_eos", default=False):
        req.ignore_eos = True


@dataclass(frozen=True)
class TokenInfo:
    """One generated token for logprobs: its text, logprob and top candidates [(text, logprob)]."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


def token_infos(resp) -> list[TokenInfo]:
    """The logprob entries of one GenerateResponse (empty unless logprobs were asked)."""
    if not resp.logprobs:
        return []
    tops = list(resp.top_logprobs)
    out = []
    for i, lp in enumerate(resp.logprobs):
        token = resp.tokens[i] if i < len(resp.tokens) else ""
        top = tuple((c.token, c.logprob) for c in tops[i].candidates) if i < len(tops) else ()
        out.append(TokenInfo(token, lp, top))
    return out


@dataclass
class Collected:
    """A whole generation, parsed."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tokens: list[TokenInfo] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = ""
    stop_string: str = ""

    def add(self, events) -> None:
        for e in events:
            if isinstance(e, Reasoning):
                self.reasoning += e.text
            elif isinstance(e, Content):
                self.content += e.text
            else:
                self.tool_calls.append(e)


async def collect(stream, parser: OutputParser) -> Collected:
    out = Collected()
    async for resp in stream:
        out.add(parser.feed(resp.text))
        out.tokens += token_infos(resp)
        if resp.finish_reason:
            out.add(parser.flush())
            out.finish_reason = resp.finish_reason
            out.stop_string = resp.stop_string
            out.prompt_tokens = resp.usage.prompt_tokens
            out.completion_tokens = resp.usage.completion_tokens
            out.cached_tokens = resp.usage.cached_tokens
    return out
