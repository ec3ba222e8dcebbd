"""The language model inside a multimodal checkpoint, read under the plain causal-LM tensor names.

A vision-language checkpoint whose text model is served alone (Kimi-K2.5, a Qwen3.5-MoE VL checkpoint)
stores it under a prefix; the models and the expert loader ask for `model.*` and `lm_head.*`, so the
reader answers those names from the prefixed tensors. Vision tensors keep their names (never read).

  published Kimi-K2.5 (and LLaVA-style)   language_model.model.*     language_model.lm_head.*
  transformers 5 saves of VL models        model.language_model.*     lm_head.*
  transformers 5 saves of Kimi-K2.5        language_model.model.blocks.N.* (its weight-name conversion
                                           renames the vision tower's `blocks` to `layers` on load and
                                           reverses that everywhere on save)
"""
from __future__ import annotations

from typing import Iterable

# (stored prefix, causal-LM prefix); longer stored prefixes first
NESTED_PREFIXES = (
    ("language_model.model.blocks.", "model.layers."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)


def language_model_aliases(names: Iterable[str]) -> dict[str, str]:
    """causal-LM name -> stored name for a checkpoint whose language model is nested; {} when the
    checkpoint already holds `model.layers.*` / `model.embed_tokens.*` itself."""
    names = list(names)
    if any(n.startswith(("model.layers.", "model.embed_tokens.")) for n in names):
        return {}
    aliases: dict[str, str] = {}
    for name in names:
        for stored, plain in NESTED_PREFIXES:
            if name.startswith(stored):
                aliases[plain + name[len(stored):]] = name
                break
    return aliases
