"""MiniMaxM2ForCausalLM config: grouped-query attention with q/k RMSNorm over all heads at once and
partial rotary (`rotary_dim`, or `partial_rotary_factor`), a sigmoid router with a selection bias
(`e_score_correction_bias`) and renormalised top-k weights, every layer MoE, no shared experts."""
from __future__ import annotations

from typing import Any

from moemesh.config import ConfigError, ModelConfig, common_fields
from moemesh.models.deepseek_v3.config import GroupedGateConfig, rope_parameters

# The gate as transformers' MiniMaxM2TopKRouter runs it: one group, weights renormalised, not scaled
GATE = GroupedGateConfig(n_group=1, topk_group=1, routed_scaling_factor=1.0, n_shared_experts=0, first_k_dense_replace=0)


def rotary_dim(cfg: ModelConfig) -> int:
    """Rotated dims per head: `rotary_dim` (the released checkpoints' field), else head_dim times
    `partial_rotary_factor`, else the whole head."""
    raw = cfg.raw
    factor = rope_parameters(raw).get("partial_rotary_factor")
    if raw.get("rotary_dim") is not None:
        dim = int(raw["rotary_dim"])
    else:
        dim = int(cfg.head_dim * float(factor if factor is not None else 1.0))
    if dim <= 0 or dim % 2 or dim > cfg.head_dim:
        raise ConfigError(f"config field rotary_dim must be even and in (0, head_dim={cfg.head_dim}], got {dim}")
    return dim


def parse_config(raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    fields = common_fields(raw, generation)
    scoring = raw.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"config field scoring_func must be 'sigmoid' for MiniMax-M2, got {scoring!r}")
    kinds = raw.get("attn_type_list")
    if kinds is not None and any(int(k) != 1 for k in kinds):
        raise ConfigError(f"config field attn_type_list: only full attention (1) layers are supported, got {kinds!r}")
    rope = rope_parameters(raw)
    if rope["rope_type"] != "default":
        raise ConfigError(f"config field rope_parameters.rope_type must be 'default' for MiniMax-M2, got {rope['rope_type']!r}")
    fields.update(sliding_window=None, intermediate_size=0)
    cfg = ModelConfig(
        **fields,
        qk_norm=True,
        num_experts=int(raw.get("num_local_experts") or raw.get("num_experts") or 0),
        top_k=int(raw.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(raw["intermediate_size"]),
        norm_topk_prob=True,
    )
    if cfg.num_experts <= 0:
        raise ConfigError("config field num_local_experts must be > 0 for MiniMax-M2")
    rotary_dim(cfg)
    return cfg
