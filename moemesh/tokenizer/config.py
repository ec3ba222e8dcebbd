"""`TokenizerConfig`: the parts of `tokenizer_config.json` and `generation_config.json` the tokenizer needs."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_content(value: Any, field: str) -> str | None:
    """A special token as written in `tokenizer_config.json`: a string, an AddedToken dict or null."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"tokenizer_config.json: {field} must be a string or {{'content': ...}}, got {value!r}")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _id_list(value: Any, field: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise ValueError(f"generation_config.json: {field} must be an int or a list of ints, got {value!r}")


@dataclass(frozen=True)
class TokenizerConfig:
    """Special tokens (as strings), encode flags, chat template and generation eos ids of a model dir."""

    special_tokens: dict[str, str]  # "bos_token" | "eos_token" | "unk_token" | "pad_token" -> content
    add_bos_token: bool = False
    add_eos_token: bool = False
    clean_up_tokenization_spaces: bool = False
    chat_template: str | None = None
    generation_eos_token_ids: tuple[int, ...] = ()
    generation_bos_token_id: int | None = None

    @classmethod
    def from_model_dir(cls, path: Path) -> "TokenizerConfig":
        path = Path(path)
        tc = _read_json(path / "tokenizer_config.json")
        gc = _read_json(path / "generation_config.json")
        special = {}
        for key in SPECIAL_TOKEN_KEYS:
            content = _token_content(tc.get(key), key)
            if content is not None:
                special[key] = content
        template_file = path / "chat_template.jinja"
        if template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _template_from_config(tc.get("chat_template"))
        bos = gc.get("bos_token_id")
        if bos is not None and (not isinstance(bos, int) or isinstance(bos, bool)):
            raise ValueError(f"generation_config.json: bos_token_id must be an int, got {bos!r}")
        return cls(
            special_tokens=special,
            add_bos_token=bool(tc.get("add_bos_token", False)),
            add_eos_token=bool(tc.get("add_eos_token", False)),
            clean_up_tokenization_spaces=bool(tc.get("clean_up_tokenization_spaces", False)),
            chat_template=chat_template,
            generation_eos_token_ids=_id_list(gc.get("eos_token_id"), "eos_token_id"),
            generation_bos_token_id=bos,
        )


def _template_from_config(value: Any) -> str | None:
    """`chat_template` in tokenizer_config.json: a string, or a list of {name, template} (the "default" one)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in named and isinstance(named["default"], str):
            return named["default"]
    raise ValueError(f"tokenizer_config.json: chat_template must be a string or a list with a 'default' entry, got {value!r}")
