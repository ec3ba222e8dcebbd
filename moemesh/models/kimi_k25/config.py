"""Kimi-K2.5 config: the DeepSeek-V3 `text_config` (deepseek_v3/config.py) plus the placeholder tokens
of images and videos, which the served language model refuses."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from moemesh.config import ModelConfig
from moemesh.models.deepseek_v3.config import parse_config as parse_deepseek_v3
from moemesh.models.multimodal import language_model_raw, media_token_ids

ARCHITECTURE_NAMES = ("Kimi_K25ForConditionalGeneration", "KimiK25ForConditionalGeneration")
# transformers' Kimi_K25Config defaults; the published config also names media_placeholder_token_id
MEDIA_DEFAULTS = {"image_token_id": 163605, "video_token_id": 163840, "media_placeholder_token_id": None}
TIE_DEFAULT = True  # Kimi_K25Config.tie_word_embeddings


def parse_config(raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    # The published INT4 compressed-tensors experts have no kernel here: refused with every format no
    # loader reads (registry.check_quant_method); a bfloat16 or BlockwiseFP8 conversion loads.
    text = language_model_raw(raw, TIE_DEFAULT)
    return replace(parse_deepseek_v3(text, generation), media_token_ids=media_token_ids(raw, MEDIA_DEFAULTS))
