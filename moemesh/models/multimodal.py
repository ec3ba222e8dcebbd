"""Serving the language model of a vision-language checkpoint alone (Kimi-K2.5, Qwen3.5-MoE VL): its
`text_config` is the config of a text model the project serves; images cannot come in, so prompts
holding the image/video placeholder tokens are refused (ModelConfig.media_token_ids). The checkpoint
reader answers the text model's tensor names (moemesh/checkpoint/nesting.py)."""
from __future__ import annotations

from typing import Any

from moemesh.config import ConfigError


def language_model_raw(raw: dict[str, Any], tie_default: bool) -> dict[str, Any]:
    """The text model's config dict under the outer `architectures`; quantization_config and
    tie_word_embeddings from the outer config when it sets them (transformers reads the outer flag;
    tie_default is the outer config class's default)."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        arch = (raw.get("architectures") or ["?"])[0]
        raise ConfigError(f"config field text_config must hold the language model's config for {arch}")
    merged = dict(text)
    merged["architectures"] = list(raw["architectures"])
    if raw.get("quantization_config") is not None:
        merged["quantization_config"] = raw["quantization_config"]
    merged["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", tie_default))
    for key in ("dtype", "torch_dtype"):
        if merged.get(key) is None and raw.get(key) is not None:
            merged[key] = raw[key]
    return merged


def media_token_ids(raw: dict[str, Any], defaults: dict[str, int]) -> tuple[int, ...]:
    """The placeholder ids the outer config names (`defaults` stand in for fields it omits)."""
    ids = {int(raw.get(key, value)) for key, value in defaults.items() if raw.get(key, value) is not None}
    return tuple(sorted(ids))
