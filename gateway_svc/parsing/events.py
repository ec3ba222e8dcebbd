"""`OutputParser`: one request's streamed text -> `Reasoning`, `Content` and `ToolCall` events.

Reasoning is split first (`<think>` at the start), then tool calls are taken out of the content
(only when the request offered tools). Both HTTP APIs render these events in their own shapes.
"""
from __future__ import annotations

from dataclasses import dataclass

from gateway_svc.parsing.reasoning import ReasoningSplitter
from gateway_svc.parsing.tool_calls import ToolCall, ToolCallSplitter


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class Content:
    text: str


Event = Reasoning | Content | ToolCall


class OutputParser:
    def __init__(self, reasoning: bool = True, tools: bool = False) -> None:
        self._reasoning = ReasoningSplitter() if reasoning else None
        self._tools = ToolCallSplitter() if tools else None

    @property
    def tool_calls(self) -> int:
        return self._tools.calls if self._tools is not None else 0

    def feed(self, text: str) -> list[Event]:
        pieces = self._reasoning.feed(text) if self._reasoning is not None else [("content", text)]
        return self._route(pieces, final=False)

    def flush(self) -> list[Event]:
        pieces = self._reasoning.flush() if self._reasoning is not None else []
        return self._route(pieces, final=True)

    def _route(self, pieces: list[tuple[str, str]], final: bool) -> list[Event]:
        out: list[Event] = []
        for kind, text in pieces:
            if kind == "reasoning":
                out.append(Reasoning(text))
            elif self._tools is None:
                out.append(Content(text))
            else:
                out.extend(self._wrap(self._tools.feed(text)))
        if final and self._tools is not None:
            out.extend(self._wrap(self._tools.flush()))
        return _merge(out)

    @staticmethod
    def _wrap(items: list[str | ToolCall]) -> list[Event]:
        return [Content(i) if isinstance(i, str) else i for i in items]


def _merge(events: list[Event]) -> list[Event]:
    """Adjacent pieces of the same kind joined; empty ones dropped."""
    out: list[Event] = []
    for e in events:
        if isinstance(e, (Reasoning, Content)):
            if not e.text:
                continue
            if out and type(out[-1]) is type(e):
                out[-1] = type(e)(out[-1].text + e.text)
                continue
        out.append(e)
    return out
