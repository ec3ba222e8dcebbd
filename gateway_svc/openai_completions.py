"""OpenAI `POST /v1/completions`: a text prompt (or token ids) -> a `text_completion` object or
its chunks. The text comes back as generated (no reasoning or tool-call parsing). `logprobs: N`
gives each token's logprob and its N most likely alternatives. Refused with 400: several prompts,
`n`/`best_of` > 1, `echo`, `suffix`, non-zero penalties and `logit_bias`."""
from __future__ import annotations

import time
from dataclasses import dataclass

from gateway_svc.body import Fields
from gateway_svc.common import TokenInfo, check_model, new_id, set_sampling, stop_strings, token_infos
from gateway_svc.errors import bad_request
from gateway_svc.openai_chat import usage
from moemesh.rpc.generation import pb

NAMES = {"max_new_tokens": "max_tokens", "prompt_token_ids": "prompt", "top_logprobs": "logprobs"}
DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for completions


@dataclass(frozen=True)
class CompletionOptions:
    model: str
    stream: bool
    include_usage: bool
    logprobs: bool


def prompt_into(req, f: Fields) -> None:
    """`prompt`: a string, token ids, or a one-element array of either."""
    value = f.raw("prompt")
    if value is None:
        raise bad_request("prompt: required", "prompt")
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        if len(value) != 1:
            raise bad_request(f"prompt: one prompt per request is supported, got {len(value)}", "prompt")
        value = value[0]
    if isinstance(value, str):
        req.prompt = value
    elif isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        req.prompt_token_ids.ids.extend(value)
    else:
        raise bad_request("prompt: must be a string or an array of token ids", "prompt")


def parse(body: dict, served: str) -> tuple[object, CompletionOptions]:
    f = Fields(body)
    model = check_model(f, served)
    for key in ("n", "best_of"):
        if f.int(key, default=1) != 1:
            raise bad_request(f"{key}: only one choice per request is supported", key)
    if f.bool("echo", default=False):
        raise bad_request("echo: not supported by this server", "echo")
    if f.str("suffix"):
        raise bad_request("suffix: not supported by this server", "suffix")
    f.reject_nonzero("presence_penalty", "frequency_penalty")
    if f.sub("logit_bias").obj:
        raise bad_request("logit_bias: not supported by this server", "logit_bias")
    req = pb.GenerateRequest()
    prompt_into(req, f)
    set_sampling(req, f, f.int("max_tokens", default=DEFAULT_MAX_TOKENS))
    req.stop.extend(stop_strings(f, "stop"))
    top = f.int("logprobs", lo=0, hi=20)
    req.logprobs = top is not None
    req.top_logprobs = top or 0
    return req, CompletionOptions(model, f.bool("stream", default=False),
                                  bool(f.sub("stream_options").bool("include_usage", default=False)), top is not None)


def logprobs_json(tokens: list[TokenInfo], offset: int) -> dict:
    """The completions API's logprobs: tokens, token_logprobs, top_logprobs ({text: logprob}), text_offset."""
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t.token)
    return {"tokens": [t.token for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [dict(t.top) for t in tokens], "text_offset": offsets}


async def complete(stream, opts: CompletionOptions) -> dict:
    text, tokens, last = "", [], None
    async for resp in stream:
        text += resp.text
        tokens += token_infos(resp)
        last = resp
    u = last.usage
    return {
        "id": new_id("cmpl-"), "object": "text_completion", "created": int(time.time()), "model": opts.model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs_json(tokens, 0) if opts.logprobs else None,
                     "finish_reason": last.finish_reason}],
        "usage": usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens),
    }


async def chunks(stream, opts: CompletionOptions):
    cid, created, offset = new_id("cmpl-"), int(time.time()), 0

    def chunk(text: str, finish: str | None, logprobs) -> dict:
        out = {"id": cid, "object": "text_completion", "created": created, "model": opts.model,
               "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
        if opts.include_usage:
            out["usage"] = None
        return out

    async for resp in stream:
        tokens = token_infos(resp)
        if resp.text or tokens or resp.finish_reason:
            yield chunk(resp.text, resp.finish_reason or None, logprobs_json(tokens, offset) if opts.logprobs else None)
            offset += len(resp.text)
        if resp.finish_reason and opts.include_usage:
            u = resp.usage
            yield {"id": cid, "object": "text_completion", "created": created, "model": opts.model, "choices": [],
                   "usage": usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)}
