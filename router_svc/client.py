"""A client of the public Generation service, used by `moemesh generate`, `demo` and `bench`.

`build_request(...)` makes a GenerateRequest; `Completion` accumulates a response stream into the
JSON object `moemesh run --json` prints.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moemesh.rpc.protos import load

pb, pb_grpc = load("generation")


def build_request(
    *,
    prompt: str | None = None,
    prompt_token_ids=None,
    messages=None,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop=(),
    logprobs: bool = False,
    prompt_logprobs: bool = False,
    ignore_eos: bool = False,
    request_id: str = "",
    model: str = "",
):
    """A GenerateRequest; exactly one of prompt / prompt_token_ids / messages ([(role, content)])."""
    req = pb.GenerateRequest(
        request_id=request_id, model=model, max_new_tokens=max_new_tokens, temperature=temperature,
        top_p=top_p, top_k=top_k, seed=seed, stop=list(stop), logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, ignore_eos=ignore_eos,
    )
    if prompt_token_ids is not None:
        req.prompt_token_ids.ids.extend(prompt_token_ids)
    elif messages is not None:
        req.messages.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in messages)
    else:
        req.prompt = prompt if prompt is not None else ""
    return req


@dataclass
class Completion:
    """One request's stream, accumulated."""

    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None

    def add(self, resp) -> str:
        """Adds one GenerateResponse; returns its text delta."""
        self.token_ids.extend(resp.token_ids)
        self.logprobs.extend(resp.logprobs)
        self.text += resp.text
        if resp.finish_reason:
            self.finish_reason = resp.finish_reason
            self.prompt_token_ids = list(resp.prompt_token_ids)
            if resp.prompt_logprobs:
                self.prompt_logprobs = [p.logprob if p.HasField("logprob") else None for p in resp.prompt_logprobs]
        return resp.text

    def to_json(self) -> dict:
        """The object `moemesh run --json` prints."""
        return {
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "logprobs": self.logprobs,
            "prompt_logprobs": self.prompt_logprobs,
        }
