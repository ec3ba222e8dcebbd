"""`Tokenizer`: a model directory's tokenizer (`tokenizer.json` via the `tokenizers` library), its
special tokens and eos ids (`tokenizer_config.json`, `generation_config.json`) and chat template."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from moemesh.tokenizer.chat_template import ChatTemplate
from moemesh.tokenizer.config import TokenizerConfig

# transformers' `clean_up_tokenization` replacements, applied when the config asks for them.
_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class Tokenizer:
    """Encode/decode text, special token ids and chat template of one model.

    Attributes: `eos_token_ids: list[int]` (generation_config's eos ids, then the tokenizer's eos
    token), `bos_token_id: int | None`, `pad_token_id: int | None`, `vocab_size: int` (added tokens
    included), `has_chat_template: bool`, `config: TokenizerConfig`.
    """

    def __init__(self, backend: Any, config: TokenizerConfig) -> None:
        self._backend = backend
        self.config = config
        self._max_token_bytes: int | None = None
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = self._special_id("bos_token", config.generation_bos_token_id)
        self.pad_token_id: int | None = self._special_id("pad_token", None)
        tok_eos = self._special_id("eos_token", None)
        eos = list(config.generation_eos_token_ids)
        if tok_eos is not None and tok_eos not in eos:
            eos.append(tok_eos)
        self.eos_token_ids: list[int] = eos
        self._chat_template = ChatTemplate(config.chat_template) if config.chat_template else None
        # add_bos_token/add_eos_token apply only where tokenizer.json's post-processor does not already add them.
        self._prepend_bos = config.add_bos_token and self.bos_token_id is not None and not self._backend_adds(self.bos_token_id, first=True)
        self._append_eos_id = tok_eos if config.add_eos_token and tok_eos is not None and not self._backend_adds(tok_eos, first=False) else None

    @classmethod
    def from_model_dir(cls, path: str | Path) -> "Tokenizer":
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json (a model directory needs one to encode text; use token ids instead)")
        try:
            backend = Backend.from_file(str(file))
        except Exception as exc:  # the tokenizers library raises a bare Exception on bad files
            raise ValueError(f"{file}: cannot be read by the tokenizers library ({exc})") from exc
        return cls(backend, TokenizerConfig.from_model_dir(path))

    def _special_id(self, key: str, fallback: int | None) -> int | None:
        content = self.config.special_tokens.get(key)
        if content is not None:
            tid = self._backend.token_to_id(content)
            if tid is not None:
                return tid
        return fallback

    def _backend_adds(self, token_id: int, first: bool) -> bool:
        """Whether tokenizer.json's post-processor already adds `token_id` at the start (`first`) or end."""
        plain = self._backend.encode("a", add_special_tokens=False).ids
        full = self._backend.encode("a", add_special_tokens=True).ids
        extra = full[: len(full) - len(plain)] if first else full[len(plain):]
        return len(full) > len(plain) and token_id in extra

    @property
    def special_tokens(self) -> dict[str, str]:
        return dict(self.config.special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    @property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of any vocabulary entry (added tokens included): no token of an
        encoding stands for more bytes of normalized text (byte-level entries over-count)."""
        if self._max_token_bytes is None:
            vocab = self._backend.get_vocab(with_added_tokens=True)
            self._max_token_bytes = max((len(t.encode("utf-8")) for t in vocab), default=1)
        return self._max_token_bytes

    @property
    def normalizes(self) -> bool:
        """Whether tokenizer.json has a normalizer (text may change length before it is tokenized)."""
        return self._backend.normalizer is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Runs mostly without holding the GIL, so a long text encoded on a
        worker thread does not stall an event loop: the batch API of `tokenizers` releases it (the
        single-text one does not), and its fast variant skips the character offsets, whose encoding
        object is also slow to free (with the GIL held)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        batch = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
        ids = batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self._prepend_bos:
            ids.insert(0, self.bos_token_id)
        if add_special_tokens and self._append_eos_id is not None:
            ids.append(self._append_eos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Ids the tokenizer does not know (a model vocabulary padded past the
        tokenizer's) decode to nothing, as in transformers; negative ids are a ValueError."""
        ids = [int(i) for i in ids]
        for i in ids:
            if i < 0:
                raise ValueError(f"token ids must be >= 0, got {i}")
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.config.clean_up_tokenization_spaces:
            for old, new in _CLEANUP:
                text = text.replace(old, new)
        return text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` ([{"role", "content"}, ...]) to the prompt text (not tokenized)."""
        if self._chat_template is None:
            raise ValueError("this model has no chat template (no chat_template.jinja and no chat_template in tokenizer_config.json)")
        return self._chat_template.render(messages, add_generation_prompt=add_generation_prompt, special_tokens=self.config.special_tokens, **kwargs)
