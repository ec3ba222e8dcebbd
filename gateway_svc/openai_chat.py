"""OpenAI `POST /v1/chat/completions`: the request -> a GenerateRequest, the responses -> a
`chat.completion` object or `chat.completion.chunk` events.

Supported beyond the basics: tools (`tool_calls` out, `role: tool` results and assistant
`tool_calls` back in), reasoning (`reasoning_content`), `reasoning_effort` and
`chat_template_kwargs` (passed to the chat template), `logprobs`/`top_logprobs`,
`stream_options.include_usage`, and vLLM's `top_k`, `ignore_eos`, `continue_final_message`.
Refused with 400 rather than ignored: `n` > 1, forced tool choice, non-text content, response
formats other than text, non-zero penalties and `logit_bias`.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from gateway_svc.body import Fields, type_name
from gateway_svc.common import TokenInfo, check_model, new_id, set_sampling, stop_strings, template_kwargs, token_infos
from gateway_svc.errors import bad_request
from gateway_svc.parsing import Content, OutputParser, Reasoning, ToolCall
from moemesh.rpc.generation import pb

ROLES = ("system", "developer", "user", "assistant", "tool")
# Router field names as this API names them (for error messages and `param`).
NAMES = {"max_new_tokens": "max_tokens", "prompt": "messages", "stop": "stop", "tools": "tools"}


@dataclass(frozen=True)
class ChatOptions:
    model: str
    stream: bool
    include_usage: bool
    logprobs: bool
    tools: bool  # tools offered (and not tool_choice "none"): parse tool calls
    max_tokens_name: str


def text_content(f: Fields, key: str, allow_none: bool = False) -> str:
    """A message's `content`: a string, or an array of text parts (joined by newlines)."""
    value = f.raw(key)
    if value is None:
        if allow_none:
            return ""
        raise bad_request(f"{f.name(key)}: required", f.name(key))
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"{f.name(key)}: must be a string or an array of content parts, got {type_name(value)}", f.name(key))
    texts = []
    for j, part in enumerate(value):
        p = f.item(key, j, part)
        kind = p.str("type", required=True)
        if kind in ("text", "input_text", "output_text"):
            texts.append(p.str("text", required=True))
        elif kind == "refusal":
            texts.append(p.str("refusal", required=True))
        else:
            raise bad_request(f"{p.path}.type: {kind!r} content is not supported; this model takes text only", f"{p.path}.type")
    return "\n".join(texts)


def to_message(f: Fields):
    role = f.str("role", required=True, choices=ROLES)
    msg = pb.ChatMessage(role="system" if role == "developer" else role)
    msg.content = text_content(f, "content", allow_none=role == "assistant")
    if role == "assistant":
        for j, call in enumerate(f.list("tool_calls")):
            c = f.item("tool_calls", j, call)
            fn = c.sub("function")
            args = fn.raw("arguments", "{}")
            if not isinstance(args, str):  # some clients send the object itself
                args = json.dumps(args)
            msg.tool_calls.append(pb.ToolCall(id=c.str("id", default=""), name=fn.str("name", required=True), arguments=args))
        reasoning = f.str("reasoning_content") or f.str("reasoning")
        if reasoning:
            msg.reasoning_content = reasoning
    if role == "tool":
        msg.tool_call_id = f.str("tool_call_id", default="")
    if f.has("name") and role == "tool":
        msg.name = f.str("name")
    return msg


def to_tool(f: Fields):
    kind = f.str("type", default="function")
    if kind != "function":
        raise bad_request(f"{f.name('type')}: only function tools are supported, got {kind!r}", f.name("type"))
    fn = f.sub("function")
    params = fn.sub("parameters")
    return pb.Tool(name=fn.str("name", required=True), description=fn.str("description", default=""),
                   parameters=json.dumps(params.obj) if params.obj else "")


def tool_choice(f: Fields) -> str:
    """"auto" or "none"; a forced choice cannot be enforced here, so it is refused."""
    value = f.raw("tool_choice", "auto")
    if value in ("auto", "none"):
        return value
    raise bad_request("tool_choice: only \"auto\" and \"none\" are supported (this server cannot force a tool call)", "tool_choice")


def parse(body: dict, served: str) -> tuple[object, ChatOptions]:
    f = Fields(body)
    model = check_model(f, served)
    if f.int("n", default=1) != 1:
        raise bad_request("n: only one choice per request is supported", "n")
    f.reject_nonzero("presence_penalty", "frequency_penalty")
    if f.sub("logit_bias").obj:
        raise bad_request("logit_bias: not supported by this server", "logit_bias")
    fmt = f.sub("response_format").str("type", default="text")
    if fmt != "text":
        raise bad_request(f"response_format.type: only \"text\" is supported, got {fmt!r}", "response_format.type")
    messages = f.list("messages", required=True)
    if not messages:
        raise bad_request("messages: must not be empty", "messages")
    req = pb.GenerateRequest()
    req.messages.messages.extend(to_message(f.item("messages", i, m)) for i, m in enumerate(messages))
    choice = tool_choice(f)
    tools = [to_tool(f.item("tools", i, t)) for i, t in enumerate(f.list("tools"))]
    if tools and choice != "none":
        req.tools.extend(tools)
    kwargs = template_kwargs(f)
    effort = f.str("reasoning_effort")
    if effort is not None:
        kwargs.setdefault("reasoning_effort", json.dumps(effort))
    for name, value in kwargs.items():
        req.chat_template_kwargs[name] = value
    if f.bool("continue_final_message", default=False):
        req.continue_final_message = True
    max_name = "max_completion_tokens" if f.has("max_completion_tokens") else "max_tokens"
    set_sampling(req, f, f.int(max_name))
    req.stop.extend(stop_strings(f, "stop"))
    logprobs = f.bool("logprobs", default=False)
    top = f.int("top_logprobs", default=0, lo=0, hi=20)
    if top and not logprobs:
        raise bad_request("top_logprobs: needs logprobs: true", "top_logprobs")
    req.logprobs = logprobs
    req.top_logprobs = top
    stream = f.bool("stream", default=False)
    opts = f.sub("stream_options")
    return req, ChatOptions(model, stream, bool(opts.bool("include_usage", default=False)), logprobs,
                            bool(req.tools), max_name)


def parser_for(opts: ChatOptions, reasoning: bool, tools: bool) -> OutputParser:
    return OutputParser(reasoning=reasoning, tools=tools and opts.tools)


def logprobs_content(tokens: list[TokenInfo]) -> list[dict]:
    return [
        {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode()),
         "top_logprobs": [{"token": s, "logprob": lp, "bytes": list(s.encode())} for s, lp in t.top]}
        for t in tokens
    ]


def finish_reason(reason: str, tool_calls: int) -> str:
    return "tool_calls" if tool_calls and reason == "stop" else reason


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def tool_call_json(call: ToolCall, index: int | None = None) -> dict:
    out = {"id": new_id("call_"), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": index, **out} if index is not None else out


def completion(result, opts: ChatOptions) -> dict:
    """The `chat.completion` object of a collected generation."""
    message: dict = {"role": "assistant", "content": result.content if result.content or not result.tool_calls else None}
    if result.reasoning:
        message["reasoning_content"] = result.reasoning
    if result.tool_calls:
        message["tool_calls"] = [tool_call_json(c) for c in result.tool_calls]
    return {
        "id": new_id("chatcmpl-"), "object": "chat.completion", "created": int(time.time()), "model": opts.model,
        "choices": [{
            "index": 0, "message": message,
            "logprobs": {"content": logprobs_content(result.tokens)} if opts.logprobs else None,
            "finish_reason": finish_reason(result.finish_reason, len(result.tool_calls)),
        }],
        "usage": usage(result.prompt_tokens, result.completion_tokens, result.cached_tokens),
    }


async def chunks(stream, opts: ChatOptions, parser: OutputParser):
    """The `chat.completion.chunk` objects of a streamed generation, in order."""
    cid, created = new_id("chatcmpl-"), int(time.time())

    def chunk(delta: dict, finish: str | None = None, logprobs: list | None = None) -> dict:
        out = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": opts.model,
               "choices": [{"index": 0, "delta": delta, "logprobs": {"content": logprobs} if logprobs is not None else None,
                            "finish_reason": finish}]}
        if opts.include_usage:
            out["usage"] = None
        return out

    yield chunk({"role": "assistant", "content": ""})
    calls = 0
    async for resp in stream:
        events = parser.feed(resp.text)
        if resp.finish_reason:
            events += parser.flush()
        deltas = []
        for e in events:
            if isinstance(e, Content):
                deltas.append({"content": e.text})
            elif isinstance(e, Reasoning):
                deltas.append({"reasoning_content": e.text})
            else:
                deltas.append({"tool_calls": [tool_call_json(e, calls)]})
                calls += 1
        lps = logprobs_content(token_infos(resp)) if opts.logprobs else None
        if lps and not deltas:
            deltas.append({})
        for i, delta in enumerate(deltas):
            yield chunk(delta, logprobs=lps if i == 0 else None)
        if resp.finish_reason:
            yield chunk({}, finish=finish_reason(resp.finish_reason, calls))
            if opts.include_usage:
                u = resp.usage
                yield {"id": cid, "object": "chat.completion.chunk", "created": created, "model": opts.model, "choices": [],
                       "usage": usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)}
