"""`ReasoningSplitter`: `<think>...</think>` at the start of the output is reasoning, the rest content.

The Qwen3 / DeepSeek-R1 convention: output that begins (after whitespace) with `<think>` is reasoning
until `</think>`; output that does not is all content. The newlines right inside the tags and right
after `</think>` belong to neither. An unterminated `<think>` (the length limit hit while thinking)
leaves everything as reasoning.

    s = ReasoningSplitter()
    s.feed("<thi") -> []                      # could still be the tag
    s.feed("nk>\\nHm.</think>\\n\\nHi") -> [("reasoning", "Hm."), ("content", "Hi")]
    s.flush() -> []
"""
from __future__ import annotations

from gateway_svc.parsing.held import partial_marker

START, END = "<think>", "</think>"


class ReasoningSplitter:
    def __init__(self) -> None:
        self._state = "start"  # start -> reasoning -> after -> content, or start -> content
        self._buf = ""
        self._said = False  # some reasoning text was emitted

    def feed(self, text: str) -> list[tuple[str, str]]:
        """(kind, text) pieces now safe to emit; kind is "reasoning" or "content"."""
        self._buf += text
        out: list[tuple[str, str]] = []
        while True:
            before = (self._state, self._buf)
            self._step(out)
            if (self._state, self._buf) == before:
                return [p for p in out if p[1]]

    def _step(self, out: list[tuple[str, str]]) -> None:
        buf = self._buf
        if self._state == "start":
            lead = buf.lstrip()
            if lead.startswith(START):
                self._state, self._buf = "reasoning", lead[len(START):].lstrip("\n")
            elif not START.startswith(lead):  # (an empty or partial tag keeps waiting)
                self._state = "content"
        elif self._state == "reasoning":
            if not self._said:  # newlines right after <think> belong to neither
                buf = self._buf = buf.lstrip("\n")
            end = buf.find(END)
            if end >= 0:
                out.append(("reasoning", buf[:end].rstrip("\n")))
                self._state, self._buf = "after", buf[end + len(END):]
                return
            keep = partial_marker(buf, END)
            body = buf[: len(buf) - keep]
            safe = body.rstrip("\n")  # newlines just before </think> are dropped, so hold them
            out.append(("reasoning", safe))
            self._buf = buf[len(safe):]
            self._said = self._said or bool(safe)
        elif self._state == "after":
            lead = buf.lstrip("\n")
            if lead:
                self._state, self._buf = "content", lead
        elif buf:  # content
            out.append(("content", buf))
            self._buf = ""

    def flush(self) -> list[tuple[str, str]]:
        """What is still held at the end of the stream."""
        buf, self._buf = self._buf, ""
        if self._state == "reasoning":
            return [("reasoning", buf)] if buf.strip("\n") else []
        if self._state in ("start", "content") and buf:
            return [("content", buf)]
        return []
