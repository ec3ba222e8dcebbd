"""Tool calls in the `<tool_call>{json}</tool_call>` form (Qwen3, Hermes and many others).

The body is `{"name": ..., "arguments": {...}}` (`parameters` is taken for `arguments`; arguments given
as a JSON string are parsed). A block whose body is not such an object stays plain text, so nothing
the model wrote is lost.

`ToolCallSplitter` does this on a stream: text outside blocks passes through at once (except a tail
that could begin `<tool_call>`), a block is emitted as one `ToolCall` when it closes. Whitespace
between and after tool calls is dropped; an unterminated block at the end is parsed as far as it goes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from gateway_svc.parsing.held import partial_marker

START, END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, compact


def parse_tool_call(body: str) -> ToolCall | None:
    """The call in a block's body, or None if it is not `{"name": str, "arguments": object}`."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolCallSplitter:
    """feed(text) -> [str | ToolCall]; flush() -> the same for what is held at the end."""

    def __init__(self) -> None:
        self._buf = ""
        self._inside = False
        self._called = False  # a tool call was emitted: whitespace-only text after it is held
        self.calls = 0

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buf += text
        out: list[str | ToolCall] = []
        while True:
            if self._inside:
                end = self._buf.find(END)
                if end < 0:
                    return out
                self._emit_block(self._buf[:end], out, closed=True)
                self._buf, self._inside = self._buf[end + len(END):], False
                continue
            start = self._buf.find(START)
            if start >= 0:
                self._emit_text(self._buf[:start], out, final=True)
                self._buf, self._inside = self._buf[start + len(START):], True
                continue
            keep = partial_marker(self._buf, START)
            text, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            self._emit_text(text, out, final=False)
            return out

    def _emit_text(self, text: str, out: list, final: bool) -> None:
        """Text outside blocks; after a call, whitespace-only text waits (it may separate two calls)."""
        if self._called and not text.strip():
            if not final:
                self._buf = text + self._buf
            return
        if text:
            out.append(text)
            self._called = False

    def _emit_block(self, body: str, out: list, closed: bool) -> None:
        call = parse_tool_call(body)
        if call is None:
            self._emit_text(START + body + (END if closed else ""), out, final=True)
            return
        out.append(call)
        self.calls += 1
        self._called = True

    def flush(self) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        buf, self._buf = self._buf, ""
        if self._inside:
            self._inside = False
            self._emit_block(buf, out, closed=False)
        else:
            self._emit_text(buf, out, final=True)
        return out
