"""`RequestPreparer`: validates a client request against the model and turns it into token ids.

Every rejection names the field: `INVALID_ARGUMENT` for malformed values, `OUT_OF_RANGE` for values
beyond the model's limits, `NOT_FOUND` for an unknown model name, `FAILED_PRECONDITION` when the
model lacks what the request needs (a tokenizer for text, a chat template for messages).

Cheap checks run first and sizes before work: text is measured against `RequestLimits.text_bytes`
before it is tokenized, token ids are counted before they are validated (in one vectorized pass).
`prepare` may take a while for a long text (tokenizing): the router runs it on a worker thread.
"""
from __future__ import annotations

import json
import math
import uuid
from dataclasses import replace

import grpc

from moemesh.contracts.info import ModelInfo
from moemesh.errors import MeshError, invalid, out_of_range
from moemesh.token_ids import check_token_ids
from router_svc.limits import RequestLimits
from router_svc.types import ChatTurn, GenerationInput, SamplingSpec, SequenceSpec, ToolSpec

MAX_REQUEST_ID_LEN = 256
MAX_MODEL_NAME_LEN = 256
MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 256
MAX_TOP_LOGPROBS = 20
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128  # per message
MAX_TEMPLATE_KWARGS = 64
# Template variables a request may not override: the router sets them itself.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token", "unk_token", "pad_token"}
)


class RequestPreparer:
    """`prepare(GenerationInput) -> SequenceSpec`, raising `MeshError` on bad input.

    `tokenizer` may be None (a model directory without tokenizer.json): then only token ids work.
    """

    def __init__(self, info: ModelInfo, tokenizer=None, limits: RequestLimits | None = None) -> None:
        self.info = info
        self.tokenizer = tokenizer
        self.limits = limits or RequestLimits.for_model(info.max_context, tokenizer)

    def prepare(self, req: GenerationInput) -> SequenceSpec:
        self._check_model(req.model)
        request_id = self._request_id(req.request_id)
        self._check_stops(req.stop)
        sampling = self._check_sampling(req.sampling)
        ids, field = self._encode(req, fit=True)
        self._check_fits(len(ids), field)
        if req.fill_context and sampling.max_new_tokens is None:
            room = min(self.info.max_new_tokens_limit, self.info.max_context - len(ids))
            sampling = replace(sampling, max_new_tokens=room)
        self._check_room(sampling, len(ids))
        return SequenceSpec(request_id=request_id, prompt_token_ids=ids, sampling=self._with_eos(sampling))

    def count(self, req: GenerationInput) -> int:
        """How many prompt tokens `req`'s input makes (validated as for `prepare`, but a prompt longer
        than the context is counted, not refused; text beyond the text bound is still refused)."""
        self._check_model(req.model)
        return len(self._encode(req, fit=False)[0])

    def _with_eos(self, s: SamplingSpec) -> SamplingSpec:
        """The tokenizer's EOS ids stop generation too (as in `moemesh run`), unless ignore_eos."""
        if self.tokenizer is None or s.ignore_eos:
            return s
        extra = tuple(t for t in self.tokenizer.eos_token_ids if t not in s.stop_token_ids)
        return replace(s, stop_token_ids=s.stop_token_ids + extra) if extra else s

    def _check_model(self, model: str) -> None:
        if len(model) > MAX_MODEL_NAME_LEN:
            raise invalid(f"model: at most {MAX_MODEL_NAME_LEN} characters, got {len(model)}")
        if model and model != self.info.name:
            raise MeshError(grpc.StatusCode.NOT_FOUND, f"model: unknown model {model!r} (this mesh serves {self.info.name!r})")

    def _request_id(self, request_id: str) -> str:
        if len(request_id) > MAX_REQUEST_ID_LEN:
            raise invalid(f"request_id: at most {MAX_REQUEST_ID_LEN} characters, got {len(request_id)}")
        return request_id or uuid.uuid4().hex

    def _encode(self, req: GenerationInput, fit: bool) -> tuple[tuple[int, ...], str]:
        """The prompt's token ids and the name of the field they came from; with `fit`, ids beyond
        the context are refused before they are checked one by one."""
        if req.messages is None:
            if req.tools:
                raise invalid("tools: only a chat request (messages) can carry tools")
            if req.chat_template_kwargs:
                raise invalid("chat_template_kwargs: only a chat request (messages) uses the chat template")
            if req.continue_final_message:
                raise invalid("continue_final_message: only a chat request (messages) has a final message")
        if req.prompt_token_ids is not None:
            field = "prompt_token_ids"
            if not len(req.prompt_token_ids):
                raise invalid("prompt_token_ids: must not be empty")
            if fit:
                self._check_fits(len(req.prompt_token_ids), field)
            ids = self._check_token_ids(field, req.prompt_token_ids)
        elif req.messages is not None:
            ids = self._chat_ids(req.messages, req.tools, req.chat_template_kwargs, req.continue_final_message)
            field = "messages"
        elif req.prompt is not None:
            if not req.prompt:
                raise invalid("prompt: must not be empty")
            tok = self._require_tokenizer("prompt")
            self._check_text("prompt", _utf8_len(req.prompt))
            ids = tuple(tok.encode(req.prompt))
            field = "prompt"
            if not ids:
                raise invalid("prompt: encodes to no tokens")
        else:
            raise invalid("prompt: one of prompt, prompt_token_ids or messages is required")
        return ids, field

    def _check_fits(self, n: int, field: str) -> None:
        if n >= self.info.max_context:
            raise out_of_range(f"{field}: {n} tokens leave no room in the model's context of {self.info.max_context} tokens")

    def _check_text(self, field: str, nbytes: int) -> None:
        """Before tokenizing: text longer than any text whose tokens fit the context (see limits.py)."""
        if nbytes > self.limits.text_bytes:
            raise out_of_range(f"{field}: {nbytes} bytes of text cannot fit the model's context; at most {self.limits.describe_text()}")

    def _chat_ids(self, messages, tools=(), template_kwargs=(), continue_final: bool = False) -> tuple[int, ...]:
        if not messages:
            raise invalid("messages: must not be empty")
        if len(messages) > self.limits.max_messages:
            raise out_of_range(f"messages: at most {self.limits.max_messages} messages (one per token of the context), got {len(messages)}")
        if len(tools) > MAX_TOOLS:
            raise invalid(f"tools: at most {MAX_TOOLS}, got {len(tools)}")
        if len(template_kwargs) > MAX_TEMPLATE_KWARGS:
            raise invalid(f"chat_template_kwargs: at most {MAX_TEMPLATE_KWARGS}, got {len(template_kwargs)}")
        for i, m in enumerate(messages):
            if len(m.tool_calls) > MAX_TOOL_CALLS:
                raise invalid(f"messages[{i}].tool_calls: at most {MAX_TOOL_CALLS}, got {len(m.tool_calls)}")
        self._check_text("messages", _chat_text_bytes(messages, tools, template_kwargs))
        if continue_final and (messages[-1].role != "assistant" or not messages[-1].content):
            raise invalid("continue_final_message: the last message must be an assistant message with content")
        rendered = [_message_dict(i, m) for i, m in enumerate(messages)]
        extra = _template_kwargs(template_kwargs)
        if tools:
            extra["tools"] = [_tool_dict(i, t) for i, t in enumerate(tools)]
        tok = self._require_tokenizer("messages")
        if not tok.has_chat_template:
            raise MeshError(grpc.StatusCode.FAILED_PRECONDITION, "messages: this model has no chat template; send prompt instead")
        try:
            text = tok.apply_chat_template(rendered, add_generation_prompt=not continue_final, **extra)
        except Exception as exc:  # a template may raise on roles or content it does not support
            raise invalid(f"messages: the chat template rejected them ({exc})") from exc
        if continue_final:
            text = _cut_after_final(text, messages[-1].content)
        return tuple(tok.encode(text, add_special_tokens=False))

    def _require_tokenizer(self, field: str):
        if self.tokenizer is None:
            raise MeshError(grpc.StatusCode.FAILED_PRECONDITION, f"{field}: this model has no tokenizer; send prompt_token_ids")
        return self.tokenizer

    def _check_token_ids(self, field: str, ids) -> tuple[int, ...]:
        try:
            return tuple(check_token_ids(ids, self.info.vocab_size, field))
        except ValueError as exc:
            raise invalid(str(exc)) from None

    def _check_sampling(self, s: SamplingSpec) -> SamplingSpec:
        """Raises on a bad value; returns `s` with its stop token ids as a tuple."""
        if s.max_new_tokens is not None:
            if s.max_new_tokens < 1:
                raise invalid(f"max_new_tokens: must be >= 1, got {s.max_new_tokens}")
            if s.max_new_tokens > self.info.max_new_tokens_limit:
                raise out_of_range(
                    f"max_new_tokens: {s.max_new_tokens} is beyond the limit of {self.info.max_new_tokens_limit}"
                )
        if s.temperature is not None and not (math.isfinite(s.temperature) and s.temperature >= 0):
            raise invalid(f"temperature: must be a finite number >= 0 (0 = greedy), got {s.temperature}")
        if s.top_p is not None and not (math.isfinite(s.top_p) and 0 < s.top_p <= 1):
            raise invalid(f"top_p: must be in (0, 1], got {s.top_p}")
        if s.top_k is not None and s.top_k < 0:
            raise invalid(f"top_k: must be >= 0 (0 = off), got {s.top_k}")
        if not 0 <= s.top_logprobs <= MAX_TOP_LOGPROBS:
            raise invalid(f"top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}], got {s.top_logprobs}")
        if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise invalid(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}, got {len(s.stop_token_ids)}")
        return replace(s, stop_token_ids=self._check_token_ids("stop_token_ids", s.stop_token_ids) if len(s.stop_token_ids) else ())

    def _check_room(self, s: SamplingSpec, prompt_len: int) -> None:
        if s.max_new_tokens is not None and prompt_len + s.max_new_tokens > self.info.max_context:
            raise out_of_range(
                f"max_new_tokens: prompt ({prompt_len}) + max_new_tokens ({s.max_new_tokens}) exceeds "
                f"the model's context of {self.info.max_context} tokens"
            )

    def _check_stops(self, stops) -> None:
        if len(stops) > MAX_STOP_STRINGS:
            raise invalid(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        total = 0
        for i, s in enumerate(stops):
            if not s:
                raise invalid(f"stop[{i}]: must not be empty")
            total += _utf8_len(s)
        if total > self.limits.text_bytes:
            raise out_of_range(f"stop: {total} bytes of stop strings; at most {self.limits.describe_text()} together")


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _chat_text_bytes(messages, tools, template_kwargs) -> int:
    """All the text a chat request hands the template (what its rendering grows with)."""
    total = 0
    for m in messages:
        total += sum(_utf8_len(x) for x in (m.role, m.content, m.tool_call_id, m.name, m.reasoning_content))
        total += sum(_utf8_len(c.id) + _utf8_len(c.name) + _utf8_len(c.arguments) for c in m.tool_calls)
    total += sum(_utf8_len(t.name) + _utf8_len(t.description) + _utf8_len(t.parameters) for t in tools)
    total += sum(_utf8_len(k) + _utf8_len(v) for k, v in template_kwargs)
    return total


def _cut_after_final(text: str, content: str) -> str:
    """The rendered chat up to the end of the final message's content (its end-of-turn dropped)."""
    at = text.rfind(content)
    if at < 0:
        raise invalid("continue_final_message: the chat template does not render the last message's content as sent")
    return text[: at + len(content)]


def _json_object(text: str, field: str, empty: dict | None = None) -> dict:
    """`text` parsed as a JSON object ("" gives `empty`); INVALID_ARGUMENT naming `field` otherwise."""
    if not text and empty is not None:
        return dict(empty)
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise invalid(f"{field}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise invalid(f"{field}: must be a JSON object, got {type(value).__name__}")
    return value


def _message_dict(i: int, m: ChatTurn) -> dict:
    """A chat turn as chat templates read it (transformers' conventions: tool call arguments as a
    mapping, tool results with their call id, reasoning under `reasoning_content`)."""
    if not m.role:
        raise invalid(f"messages[{i}].role: must not be empty")
    out: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": _json_object(c.arguments, f"messages[{i}].tool_calls[{j}].arguments", empty={})}}
            for j, c in enumerate(m.tool_calls)
        ]
        for j, c in enumerate(m.tool_calls):
            if not c.name:
                raise invalid(f"messages[{i}].tool_calls[{j}].name: must not be empty")
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    if m.reasoning_content:
        out["reasoning_content"] = m.reasoning_content
    return out


def _tool_dict(i: int, t: ToolSpec) -> dict:
    if not t.name:
        raise invalid(f"tools[{i}].name: must not be empty")
    function: dict = {"name": t.name}
    if t.description:
        function["description"] = t.description
    function["parameters"] = _json_object(t.parameters, f"tools[{i}].parameters", empty={"type": "object", "properties": {}})
    return {"type": "function", "function": function}


def _template_kwargs(pairs) -> dict:
    """chat_template_kwargs (name -> JSON text) -> template variables."""
    out = {}
    for name, text in pairs:
        if not name.isidentifier():
            raise invalid(f"chat_template_kwargs: {name!r} is not a template variable name")
        if name in RESERVED_TEMPLATE_KWARGS:
            raise invalid(f"chat_template_kwargs[{name}]: set by the router itself, cannot be overridden")
        try:
            out[name] = json.loads(text)
        except ValueError as exc:
            raise invalid(f"chat_template_kwargs[{name}]: not a JSON value ({exc}); booleans are 'true', strings are quoted") from exc
    return out
