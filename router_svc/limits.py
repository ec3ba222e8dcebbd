"""`RequestLimits`: how large a public request may be, derived from the model's context length, so that
an oversized request is refused before any work is spent on it.

- **Text** (a prompt, all chat messages together, all stop strings together): at most
  `max_context * max_token_bytes * slack` UTF-8 bytes. Every token of an encoding stands for at most
  `max_token_bytes` bytes of (normalized) text: the longest vocabulary entry in UTF-8, added tokens
  included (byte-level BPE entries spell each byte as a 1-2 byte character, SentencePiece's "▁" takes
  three bytes for one space, byte-fallback entries six for one: the entry is never shorter than the
  text it stands for). `slack` is 1 when tokenizer.json has no normalizer and NORMALIZATION_SLACK
  otherwise (Unicode normalization, NFC or NFKC, shrinks text by at most 3x). So text whose tokens
  fit the context is never refused, for every tokenizer that does not delete text or map a whole
  unknown word to one token (a normalizer that drops control characters, or a WordPiece `[UNK]`,
  would let a prompt padded with such text be refused although its tokens fit). The demo model
  (context 8192, no normalizer, longest entry 162 bytes): 1,327,104 bytes.
- **Token ids**: at most `max_context` of them; on the wire at most `ID_WIRE_BYTES` each.
- **Chat messages**: at most `max_context` of them (every message takes at least one token).
- **The whole message**: one input (text, messages or ids) plus the stop strings plus
  `SMALL_FIELDS_BYTES` for the rest (ids, sampling, up to 256 stop token ids, framing). This is the
  public server's max receive size: gRPC refuses a longer message with RESOURCE_EXHAUSTED from its
  length prefix, before buffering it; receiving it to answer OUT_OF_RANGE instead would cost about
  twice its size in memory, much of it held afterwards (docs/architecture.md).
"""
from __future__ import annotations

from dataclasses import dataclass

NORMALIZATION_SLACK = 4  # Unicode normalization shrinks text by at most 3x; 4 keeps a margin
ID_WIRE_BYTES = 11  # a token id in an unpacked repeated int64: 1-byte tag + up to 10 bytes of varint
SMALL_FIELDS_BYTES = 64 * 1024
DEFAULT_MAX_TOKEN_BYTES = 256  # without a tokenizer (text is then refused anyway; this bounds stop strings)


@dataclass(frozen=True)
class RequestLimits:
    max_context: int
    text_bytes: int  # one prompt, all messages together, all stop strings together
    message_bytes: int  # a whole serialized GenerateRequest

    @classmethod
    def for_model(cls, max_context: int, tokenizer=None) -> "RequestLimits":
        """`tokenizer`: a moemesh Tokenizer (its longest entry and whether it normalizes), or None."""
        if tokenizer is None:
            per_token = DEFAULT_MAX_TOKEN_BYTES * NORMALIZATION_SLACK
        else:
            per_token = tokenizer.max_token_bytes * (NORMALIZATION_SLACK if tokenizer.normalizes else 1)
        text = max_context * per_token
        ids = max_context * ID_WIRE_BYTES
        return cls(max_context, text, max(text, ids) + text + SMALL_FIELDS_BYTES)

    @property
    def max_messages(self) -> int:
        return self.max_context

    def describe_text(self) -> str:
        return f"{self.text_bytes} bytes ({self.text_bytes // self.max_context} per token of the context of {self.max_context})"
