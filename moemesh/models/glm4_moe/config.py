"""Glm4MoeForCausalLM config: Llama-style attention fields plus partial rotary, optional q/k norm,
attention bias, and the DeepSeek-style grouped gate (n_group, topk_group, routed_scaling_factor,
shared experts, first_k_dense_replace)."""
from __future__ import annotations

from typing import Any

from moemesh.config import ConfigError, ModelConfig, common_fields
from moemesh.models.deepseek_v3.config import GroupedGateConfig, rope_parameters

DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5  # what transformers assumes when config.json omits it


def rotary_dim(cfg: ModelConfig) -> int:
    factor = float(rope_parameters(cfg.raw).get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR))
    dim = int(cfg.head_dim * factor)
    if dim <= 0 or dim % 2:
        raise ConfigError(f"config field partial_rotary_factor ({factor}) gives rotary dims {dim}; must be even and > 0")
    return dim


def parse_config(raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    fields = common_fields(raw, generation)
    gate = GroupedGateConfig.from_raw(raw)
    rope = rope_parameters(raw)
    if rope["rope_type"] != "default":
        raise ConfigError(f"config field rope_parameters.rope_type must be 'default' for GLM-4.5 MoE, got {rope['rope_type']!r}")
    fields["sliding_window"] = None
    cfg = ModelConfig(
        **fields,
        qk_norm=bool(raw.get("use_qk_norm", False)),
        num_experts=int(raw.get("n_routed_experts") or 0),
        top_k=int(raw.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 0)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        mlp_only_layers=tuple(range(min(gate.first_k_dense_replace, fields["num_layers"]))),
    )
    rotary_dim(cfg)
    return cfg
