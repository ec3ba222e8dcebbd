"""Rebuild a Hugging Face `tokenizer.json` (+ `tokenizer_config.json`) from a GGUF's tokenizer metadata.

Supports `tokenizer.ggml.model == "gpt2"` (byte-level BPE): the token list is the vocabulary in id
order, `tokenizer.ggml.merges` the BPE merges ("a b"), `tokenizer.ggml.token_type` marks control
tokens (3, special added tokens) and user-defined ones (4, plain added tokens).
`tokenizer.ggml.pre` picks the pre-tokenizer the way llama.cpp does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# llama.cpp pre-tokenizer names whose regex splits every digit on its own before the GPT-2 regex.
DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "codeshell"})
PLAIN_PRE = frozenset({"gpt2", "default"})


@dataclass(frozen=True)
class GgufTokenizerSpec:
    """Tokenizer metadata of a GGUF file."""

    model: str
    pre: str
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    chat_template: str | None

    @classmethod
    def from_fields(cls, field) -> "GgufTokenizerSpec":
        """`field(key, default)` reads GGUF metadata (see `GgufLlama.field`)."""
        tokens = tuple(field("tokenizer.ggml.tokens") or ())
        if not tokens:
            raise ValueError("GGUF metadata tokenizer.ggml.tokens is missing or empty")
        types = tuple(int(t) for t in (field("tokenizer.ggml.token_type") or [1] * len(tokens)))
        if len(types) != len(tokens):
            raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")

        def opt_id(key: str) -> int | None:
            v = field(key)
            return None if v is None else int(v)

        return cls(
            model=str(field("tokenizer.ggml.model", "")),
            pre=str(field("tokenizer.ggml.pre", "default")),
            tokens=tokens,
            token_types=types,
            merges=tuple(field("tokenizer.ggml.merges") or ()),
            bos_token_id=opt_id("tokenizer.ggml.bos_token_id"),
            eos_token_id=opt_id("tokenizer.ggml.eos_token_id"),
            unk_token_id=opt_id("tokenizer.ggml.unknown_token_id"),
            pad_token_id=opt_id("tokenizer.ggml.padding_token_id"),
            add_bos_token=bool(field("tokenizer.ggml.add_bos_token", False)),
            chat_template=field("tokenizer.chat_template"),
        )

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]


def build_backend(spec: GgufTokenizerSpec):
    """A `tokenizers.Tokenizer` equivalent to the GGUF's byte-level BPE."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if spec.model != "gpt2":
        raise ValueError(f"tokenizer.ggml.model must be 'gpt2' (byte-level BPE), got {spec.model!r}")
    if spec.pre in DIGIT_SPLIT_PRE:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
        pre = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif spec.pre in PLAIN_PRE:
        pre = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    else:
        raise ValueError(f"tokenizer.ggml.pre {spec.pre!r} is not supported (known: {sorted(DIGIT_SPLIT_PRE | PLAIN_PRE)})")
    vocab = {tok: i for i, tok in enumerate(spec.tokens)}
    merges = []
    for m in spec.merges:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ValueError(f"tokenizer.ggml.merges entry {m!r} is not 'left right'")
        merges.append((left, right))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    added = []
    for i, (tok, kind) in enumerate(zip(spec.tokens, spec.token_types)):
        if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED):
            added.append(AddedToken(tok, special=kind == TOKEN_TYPE_CONTROL, normalized=False))
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])
    return backend


def tokenizer_config(spec: GgufTokenizerSpec) -> dict[str, Any]:
    """`tokenizer_config.json` for the rebuilt tokenizer (the chat template goes to `chat_template.jinja`)."""
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": spec.add_bos_token,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "bos_token": spec.token(spec.bos_token_id),
        "eos_token": spec.token(spec.eos_token_id),
        "unk_token": spec.token(spec.unk_token_id),
        "pad_token": spec.token(spec.pad_token_id),
        "added_tokens_decoder": {
            str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": kind == TOKEN_TYPE_CONTROL}
            for i, (tok, kind) in enumerate(zip(spec.tokens, spec.token_types))
            if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
        },
    }
    return cfg
