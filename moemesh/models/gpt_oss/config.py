"""GptOssForCausalLM config: per-layer attention types (sliding / full), YaRN rope, router with bias,
the clamped SwiGLU's constants."""
from __future__ import annotations

from typing import Any

from moemesh.config import ConfigError, ModelConfig, common_fields
from moemesh.models.deepseek_v3.config import rope_parameters

LAYER_TYPES = ("sliding_attention", "full_attention")
# kernels' "swiglu_oai" activation implements exactly these constants
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def layer_types(cfg: ModelConfig) -> tuple[str, ...]:
    """One of LAYER_TYPES per layer; gpt-oss alternates sliding (even layers) and full (odd) by default."""
    types = cfg.raw.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg.num_layers)
    ]
    if len(types) != cfg.num_layers or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(f"config field layer_types must list one of {LAYER_TYPES} per layer, got {types!r}")
    return tuple(types)


def sliding_window(cfg: ModelConfig) -> int | None:
    window = cfg.raw.get("sliding_window")
    return int(window) if window else None


def parse_config(raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    fields = common_fields(raw, generation)
    for name, want in (("swiglu_alpha", SWIGLU_ALPHA), ("swiglu_limit", SWIGLU_LIMIT)):
        if float(raw.get(name, want)) != want:
            raise ConfigError(f"config field {name} must be {want} (the kernels' swiglu_oai), got {raw[name]}")
    # sliding applies per layer (layer_types), so the engine's batch-wide window stays off
    fields["sliding_window"] = None
    rope_parameters(raw)
    cfg = ModelConfig(
        **fields,
        num_experts=int(raw.get("num_local_experts") or raw.get("num_experts") or 0),
        top_k=int(raw.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(raw["intermediate_size"]),
        norm_topk_prob=True,  # softmax over the selected logits: weights sum to 1
    )
    layer_types(cfg)
    if any(t == "sliding_attention" for t in layer_types(cfg)) and sliding_window(cfg) is None:
        raise ConfigError("config field sliding_window must be set when layer_types has sliding_attention layers")
    return cfg
