"""`ChatTemplate`: renders a Jinja chat template the way transformers does.

Same environment: `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the
loop-controls extension, a `tojson` filter that does not HTML-escape, and the globals
`raise_exception`, `strftime_now`, `namespace`. The template sees `messages`,
`add_generation_prompt`, the special tokens (`bos_token`, `eos_token`, ...) and any extra kwargs.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


def _raise_exception(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = jinja2.utils.Namespace
    return env.from_string(source)


def validate_messages(messages: Any) -> list[dict]:
    """`messages` must be a list of dicts, each with a string `role` and a `content` (string or list of
    parts; None only beside `tool_calls`). Returns copies without None-valued keys and with the
    reasoning aliased, as transformers does."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise ValueError(f"messages[{i}].role is missing or not a string")
        content_ok = isinstance(m.get("content"), (str, list)) or (m.get("content") is None and "tool_calls" in m)
        if not content_ok:
            raise ValueError(f"messages[{i}].content is missing or not a string/list")
    # Keys whose value is None are dropped (as transformers does): templates handle a missing key
    # but would print a literal "None".
    return [_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in messages]


# Names a message's reasoning arrives under; templates read `reasoning_content` (gpt-oss: `thinking`).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict) -> dict:
    """Expose a message's reasoning under every name templates read, as transformers does."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template. `render(messages, add_generation_prompt, special_tokens, **kwargs) -> str`."""

    source: str
    _compiled: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ValueError("chat_template must be a non-empty string")
        object.__setattr__(self, "_compiled", _compile(self.source))

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        special_tokens: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> str:
        messages = validate_messages(messages)
        context = {**(special_tokens or {}), **kwargs}
        context.setdefault("tools", None)
        context.setdefault("documents", None)
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
