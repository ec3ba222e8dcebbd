"""`IncrementalDetokenizer`: turns a stream of token ids into text deltas.

Each `push` decodes a small window of previous tokens with and without the new one and returns the
difference, so tokenizers whose decoding of a token depends on its neighbours (SentencePiece's
leading space, byte-level BPE's multi-byte characters) come out exactly as a full decode would.
While the decoded tail ends in U+FFFD (an incomplete UTF-8 character), the text is held back.
"""
from __future__ import annotations

from typing import Sequence

from moemesh.tokenizer.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
# How many prompt tokens seed the decode window (enough context for spaces and merges).
PROMPT_WINDOW = 5
# A UTF-8 character spans at most 4 tokens: the window may move back 3 more past a split one.
MAX_CHAR_TOKENS = 4


class IncrementalDetokenizer:
    """`push(token_id) -> str` (new text, possibly empty); `flush() -> str` (any held-back text)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # Only the prompt's tail is ever decoded: a long prompt is not copied.
        self._ids: list[int] = [int(i) for i in prompt_ids[len(prompt_ids) - PROMPT_WINDOW - MAX_CHAR_TOKENS:]] \
            if len(prompt_ids) > PROMPT_WINDOW + MAX_CHAR_TOKENS else [int(i) for i in prompt_ids]
        self._read = len(self._ids)
        self._prefix = max(0, self._read - PROMPT_WINDOW)
        # Move the window start back past a split UTF-8 character, so the window decodes cleanly.
        while self._prefix > 0 and self._decode(self._prefix, self._read).startswith(REPLACEMENT):
            self._prefix -= 1
        self.text = ""  # everything emitted so far

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def _emit(self, new_text: str) -> str:
        """Advance the window past the pushed tokens; `new_text` decodes ids[prefix:]."""
        prefix_text = self._decode(self._prefix, self._read).rstrip(REPLACEMENT)
        delta = new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        new_text = self._decode(self._prefix)
        if new_text.endswith(REPLACEMENT):
            return ""  # an incomplete UTF-8 character: wait for its next bytes
        return self._emit(new_text)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the end), as the full decode renders it."""
        if self._read == len(self._ids):
            return ""
        return self._emit(self._decode(self._prefix))
