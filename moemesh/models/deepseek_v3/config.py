"""DeepSeek-V3 / Kimi-K2 config fields beyond `ModelConfig`: MLA shapes, the grouped sigmoid gate,
shared experts and dense first layers. Parsed from `config.json` (transformers 5 names, older names
such as `rope_scaling` accepted)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moemesh.config import ConfigError, ModelConfig, common_fields, rope_fields
from moemesh.models.deepseek_v3.mla import latent_slot_width


def rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """One flat rope dict: rope_theta, rope_type and the scaling fields (YaRN), from either spelling."""
    theta, scaling = rope_fields(raw)
    rope = {"rope_theta": theta, "rope_type": "default"}
    params = raw.get("rope_parameters") or {}
    if "partial_rotary_factor" in params or "partial_rotary_factor" in raw:
        rope["partial_rotary_factor"] = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor")))
    if scaling:
        rope.update(scaling)
        rope["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    return rope


@dataclass(frozen=True)
class GroupedGateConfig:
    """The sigmoid grouped top-k gate with shared experts (DeepSeek-V3, Kimi-K2, GLM-4.5)."""

    n_group: int
    topk_group: int
    routed_scaling_factor: float
    n_shared_experts: int
    first_k_dense_replace: int

    @classmethod
    def from_raw(cls, raw: dict[str, Any]) -> "GroupedGateConfig":
        scoring = raw.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ConfigError(f"config field scoring_func must be 'sigmoid' for this architecture, got {scoring!r}")
        return cls(
            n_group=int(raw.get("n_group") or 1),
            topk_group=int(raw.get("topk_group") or 1),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
        )


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    attention_bias: bool
    rope: dict[str, Any]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_raw(cls, raw: dict[str, Any]) -> "MLAConfig":
        q_rank = raw.get("q_lora_rank")
        cfg = cls(
            q_lora_rank=int(q_rank) if q_rank else None,
            kv_lora_rank=int(raw.get("kv_lora_rank", 512)),
            qk_nope_head_dim=int(raw.get("qk_nope_head_dim", 128)),
            qk_rope_head_dim=int(raw.get("qk_rope_head_dim", 64)),
            v_head_dim=int(raw.get("v_head_dim") or 128),
            rope_interleave=bool(raw.get("rope_interleave", True)),
            attention_bias=bool(raw.get("attention_bias", False)),
            rope=rope_parameters(raw),
        )
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(cfg, name) <= 0:
                raise ConfigError(f"config field {name} must be > 0, got {getattr(cfg, name)}")
        return cfg


def parse_config(raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    fields = common_fields(raw, generation)
    mla = MLAConfig.from_raw(raw)
    gate = GroupedGateConfig.from_raw(raw)
    # The KV cache holds one latent (c_kv, k_pe) per token, split across the engine's k and v tensors.
    width = latent_slot_width(mla.kv_lora_rank + mla.qk_rope_head_dim)
    fields.update(num_kv_heads=1, head_dim=width, sliding_window=None)
    return ModelConfig(
        **fields,
        num_experts=int(raw.get("n_routed_experts") or 0),
        top_k=int(raw.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 0)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        mlp_only_layers=tuple(range(min(gate.first_k_dense_replace, fields["num_layers"]))),
    )
