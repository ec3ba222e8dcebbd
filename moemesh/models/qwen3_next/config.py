"""Qwen3-Next and Qwen3.5-MoE config: which layers are Gated DeltaNet (linear attention) and which
gated full attention (`layer_types`, or every `full_attention_interval`-th layer), the linear layers'
head shapes and conv kernel, the partial rotary of the full-attention layers, and the MoE with its
gated shared expert. Qwen3.5-MoE makes every layer MoE and always renormalises the top-k weights; its
VL checkpoint (Qwen3_5MoeForConditionalGeneration) carries the text model in `text_config`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from moemesh.config import ConfigError, ModelConfig, common_fields
from moemesh.models.deepseek_v3.config import rope_parameters
from moemesh.models.multimodal import language_model_raw, media_token_ids

QWEN3_NEXT = "Qwen3NextForCausalLM"
QWEN3_5_MOE = "Qwen3_5MoeForCausalLM"
QWEN3_5_MOE_VL = "Qwen3_5MoeForConditionalGeneration"
LAYER_TYPES = ("linear_attention", "full_attention")
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25  # transformers' default for both families
VL_MEDIA_DEFAULTS = {"image_token_id": 248056, "video_token_id": 248057}  # Qwen3_5MoeConfig defaults
VL_TIE_DEFAULT = False  # Qwen3_5MoeConfig.tie_word_embeddings


@dataclass(frozen=True)
class HybridConfig:
    """layer_types: per layer "linear_attention" or "full_attention"; the Gated DeltaNet shapes
    (Hk key heads of Dk, Hv value heads of Dv, conv kernel K); rotary_dim of the full-attention heads;
    shared_expert_intermediate_size (0: none)."""

    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    rotary_dim: int
    shared_expert_intermediate_size: int

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def conv_dim(self) -> int:
        """C: q, k and v channels side by side."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.value_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> "HybridConfig":
        raw, n = cfg.raw, cfg.num_layers
        types = raw.get("layer_types")
        if types is None:
            interval = int(raw.get("full_attention_interval", 4))
            types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
        if len(types) != n or any(t not in LAYER_TYPES for t in types):
            raise ConfigError(f"config field layer_types must list one of {LAYER_TYPES} per layer, got {types!r}")
        factor = float(rope_parameters(raw).get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR))
        hc = cls(
            layer_types=tuple(types),
            linear_num_key_heads=int(raw.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(raw.get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(raw.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(raw.get("linear_value_head_dim", 128)),
            conv_kernel=int(raw.get("linear_conv_kernel_dim", 4)),
            rotary_dim=int(cfg.head_dim * factor),
            shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
        )
        if hc.linear_num_value_heads % hc.linear_num_key_heads:
            raise ConfigError(
                f"config field linear_num_key_heads ({hc.linear_num_key_heads}) must divide "
                f"linear_num_value_heads ({hc.linear_num_value_heads})"
            )
        if hc.conv_kernel < 1:
            raise ConfigError(f"config field linear_conv_kernel_dim must be >= 1, got {hc.conv_kernel}")
        if hc.rotary_dim <= 0 or hc.rotary_dim % 2 or hc.rotary_dim > cfg.head_dim:
            raise ConfigError(f"config field partial_rotary_factor ({factor}) gives rotary dims {hc.rotary_dim}; must be even and > 0")
        return hc


def parse_config(raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    arch = raw["architectures"][0]
    if arch == QWEN3_5_MOE_VL:
        text = language_model_raw(raw, VL_TIE_DEFAULT)
        return replace(parse_text(text, generation), media_token_ids=media_token_ids(raw, VL_MEDIA_DEFAULTS))
    return parse_text(raw, generation)


def parse_text(raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    qwen3_5 = raw["architectures"][0] != QWEN3_NEXT
    rope = rope_parameters(raw)
    if rope["rope_type"] != "default":
        raise ConfigError(f"config field rope_parameters.rope_type must be 'default', got {rope['rope_type']!r}")
    fields = common_fields(raw, generation)
    fields["sliding_window"] = None
    cfg = ModelConfig(
        **fields,
        qk_norm=True,
        num_experts=int(raw.get("num_experts") or 0),
        top_k=int(raw.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 0)),
        # Qwen3.5-MoE: every layer MoE, top-k weights always renormalised
        norm_topk_prob=True if qwen3_5 else bool(raw.get("norm_topk_prob", True)),
        decoder_sparse_step=1 if qwen3_5 else int(raw.get("decoder_sparse_step", 1)),
        mlp_only_layers=() if qwen3_5 else tuple(int(l) for l in raw.get("mlp_only_layers") or ()),
    )
    HybridConfig.from_model_config(cfg)
    return cfg
