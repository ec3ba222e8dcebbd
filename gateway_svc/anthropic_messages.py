"""Anthropic `POST /v1/messages` and `/v1/messages/count_tokens`: the request -> a GenerateRequest,
the responses -> a `message` object or its event stream (message_start, content_block_start,
content_block_delta..., content_block_stop, message_delta, message_stop).

`system` as a string or text blocks; `tool_use` / `tool_result` / `thinking` blocks rendered back
through the chat template; tool calls out as `tool_use` blocks (streamed as one `input_json_delta`
when the call is complete), `<think>` output as `thinking` blocks; `thinking: {type: enabled}` sets
the template's `enable_thinking`, `output_config.effort` its `reasoning_effort`; `temperature`,
`top_p` and `top_k` are taken where clients send them; an assistant message last is a prefill to
continue. Refused with 400: image and document blocks, server tools, structured output
(`output_config.format`) and a forced tool choice (`any` / `tool`), which this server cannot enforce.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from gateway_svc.body import Fields, type_name
from gateway_svc.common import check_model, new_id, set_sampling, stop_strings, template_kwargs
from gateway_svc.errors import bad_request
from gateway_svc.parsing import Content, OutputParser, Reasoning, ToolCall
from moemesh.rpc.generation import pb

NAMES = {"max_new_tokens": "max_tokens", "stop": "stop_sequences", "prompt": "messages"}


@dataclass(frozen=True)
class MessagesOptions:
    model: str
    stream: bool
    tools: bool


def blocks(f: Fields, key: str) -> list[Fields]:
    """`content` as blocks: a string is one text block."""
    value = f.raw(key)
    if isinstance(value, str):
        return [Fields({"type": "text", "text": value}, f.name(key))]
    if not isinstance(value, list):
        raise bad_request(f"{f.name(key)}: must be a string or an array of content blocks, got {type_name(value)}", f.name(key))
    return [f.item(key, i, b) for i, b in enumerate(value)]


def block_text(b: Fields) -> str:
    """A tool_result's content: a string or text blocks."""
    value = b.raw("content", "")
    if isinstance(value, str):
        return value
    texts = []
    for t in blocks(b, "content"):
        if t.str("type", required=True) != "text":
            raise bad_request(f"{t.path}.type: only text tool results are supported (text only for this model)", f"{t.path}.type")
        texts.append(t.str("text", required=True))
    return "\n".join(texts)


def system_text(f: Fields) -> str:
    if not f.has("system"):
        return ""
    parts = []
    for b in blocks(f, "system"):
        if b.str("type", required=True) != "text":
            raise bad_request(f"{b.path}.type: system blocks must be text", f"{b.path}.type")
        parts.append(b.str("text", required=True))
    return "\n".join(parts)


def to_messages(f: Fields, i: int, raw) -> list:
    """One Anthropic message -> chat messages (a user turn's tool results become `tool` messages)."""
    m = f.item("messages", i, raw)
    role = m.str("role", required=True, choices=("user", "assistant"))
    out, text = [], []
    assistant = pb.ChatMessage(role="assistant")
    for b in blocks(m, "content"):
        kind = b.str("type", required=True)
        if kind == "text":
            text.append(b.str("text", required=True))
        elif kind == "tool_result" and role == "user":
            out.append(pb.ChatMessage(role="tool", tool_call_id=b.str("tool_use_id", required=True), content=block_text(b)))
        elif kind == "tool_use" and role == "assistant":
            args = b.raw("input", {})
            if not isinstance(args, dict):
                raise bad_request(f"{b.path}.input: must be an object", f"{b.path}.input")
            assistant.tool_calls.append(pb.ToolCall(id=b.str("id", default=""), name=b.str("name", required=True), arguments=json.dumps(args)))
        elif kind == "thinking" and role == "assistant":
            assistant.reasoning_content += b.str("thinking", default="")
        elif kind == "redacted_thinking" and role == "assistant":
            continue
        else:
            raise bad_request(f"{b.path}.type: {kind!r} blocks are not supported in {role} messages (text only for this model)",
                              f"{b.path}.type")
    if role == "assistant":
        assistant.content = "".join(text)
        return [assistant]
    if text or not out:
        out.append(pb.ChatMessage(role="user", content="\n".join(text)))
    return out


def to_tool(f: Fields):
    kind = f.str("type", default="custom")
    if kind != "custom":
        raise bad_request(f"{f.name('type')}: server tools ({kind!r}) are not supported; define custom tools", f.name("type"))
    schema = f.sub("input_schema")
    return pb.Tool(name=f.str("name", required=True), description=f.str("description", default=""),
                   parameters=json.dumps(schema.obj) if schema.obj else "")


def chat_request(f: Fields):
    """The chat part shared by /v1/messages and /v1/messages/count_tokens."""
    req = pb.GenerateRequest()
    system = system_text(f)
    if system:
        req.messages.messages.append(pb.ChatMessage(role="system", content=system))
    messages = f.list("messages", required=True)
    if not messages:
        raise bad_request("messages: must not be empty", "messages")
    for i, m in enumerate(messages):
        req.messages.messages.extend(to_messages(f, i, m))
    choice = f.sub("tool_choice").str("type", default="auto")
    if choice not in ("auto", "none"):
        raise bad_request(f"tool_choice.type: only \"auto\" and \"none\" are supported (this server cannot force a tool call), got {choice!r}",
                          "tool_choice.type")
    tools = [to_tool(f.item("tools", i, t)) for i, t in enumerate(f.list("tools"))]
    if tools and choice != "none":
        req.tools.extend(tools)
    kwargs = template_kwargs(f)
    thinking = f.sub("thinking").str("type", choices=("enabled", "disabled", "adaptive", "between_tools"))
    if thinking is not None:
        kwargs.setdefault("enable_thinking", json.dumps(thinking != "disabled"))
    output = f.sub("output_config")
    if output.has("format"):
        raise bad_request("output_config.format: structured output is not supported by this server", "output_config.format")
    effort = output.str("effort")
    if effort is not None:
        kwargs.setdefault("reasoning_effort", json.dumps(effort))
    for name, value in kwargs.items():
        req.chat_template_kwargs[name] = value
    last = req.messages.messages[-1]
    if last.role == "assistant" and last.content and not last.tool_calls:
        req.continue_final_message = True  # a prefilled answer: go on from it
    return req


def parse(body: dict, served: str) -> tuple[object, MessagesOptions]:
    f = Fields(body)
    model = check_model(f, served)
    req = chat_request(f)
    set_sampling(req, f, f.int("max_tokens", required=True, lo=1))
    req.stop.extend(stop_strings(f, "stop_sequences"))
    return req, MessagesOptions(model, f.bool("stream", default=False), bool(req.tools))


def parse_count(body: dict, served: str):
    f = Fields(body)
    check_model(f, served)
    return chat_request(f)


def stop_reason(reason: str, stop_string: str, tool_calls: int) -> str:
    if reason == "length":
        return "max_tokens"
    if tool_calls and reason == "stop":
        return "tool_use"
    if stop_string:
        return "stop_sequence"
    return "end_turn"


def usage(u) -> dict:
    """Anthropic counts cached prompt tokens apart from input_tokens."""
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": u.cached_tokens}


def tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": new_id("toolu_"), "name": call.name, "input": json.loads(call.arguments)}


def message(result, opts: MessagesOptions) -> dict:
    content: list[dict] = []
    if result.reasoning:
        content.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
    if result.content:
        content.append({"type": "text", "text": result.content})
    content += [tool_use(c) for c in result.tool_calls]
    u = pb.Usage(prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
                 cached_tokens=result.cached_tokens)
    return {
        "id": new_id("msg_"), "type": "message", "role": "assistant", "model": opts.model, "content": content,
        "stop_reason": stop_reason(result.finish_reason, result.stop_string, len(result.tool_calls)),
        "stop_sequence": result.stop_string or None, "usage": usage(u),
    }


async def events(stream, opts: MessagesOptions, parser: OutputParser):
    """(event name, data) pairs of a streamed message, in the API's order."""
    first = stream.first
    yield "message_start", {"type": "message_start", "message": {
        "id": new_id("msg_"), "type": "message", "role": "assistant", "model": opts.model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {**usage(first.usage), "output_tokens": 0}}}
    index, open_kind, calls = -1, None, 0

    def start(kind: str, block: dict):
        nonlocal index, open_kind
        index += 1
        open_kind = kind
        return "content_block_start", {"type": "content_block_start", "index": index, "content_block": block}

    def stop():
        nonlocal open_kind
        open_kind = None
        return "content_block_stop", {"type": "content_block_stop", "index": index}

    async for resp in stream:
        evs = parser.feed(resp.text)
        if resp.finish_reason:
            evs += parser.flush()
        for e in evs:
            kind = "thinking" if isinstance(e, Reasoning) else "text" if isinstance(e, Content) else "tool_use"
            if open_kind is not None and (open_kind != kind or kind == "tool_use"):
                yield stop()
            if isinstance(e, Reasoning):
                if open_kind is None:
                    yield start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                              "delta": {"type": "thinking_delta", "thinking": e.text}}
            elif isinstance(e, Content):
                if open_kind is None:
                    yield start("text", {"type": "text", "text": ""})
                yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                              "delta": {"type": "text_delta", "text": e.text}}
            else:
                block = tool_use(e)
                yield start("tool_use", {**block, "input": {}})
                yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                              "delta": {"type": "input_json_delta", "partial_json": e.arguments}}
                calls += 1
        if resp.finish_reason:
            if open_kind is not None:
                yield stop()
            yield "message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": stop_reason(resp.finish_reason, resp.stop_string, calls),
                                              "stop_sequence": resp.stop_string or None},
                                    "usage": usage(resp.usage)}
            yield "message_stop", {"type": "message_stop"}
