"""Qwen3MoeForCausalLM: per-head q/k RMSNorm, optional top-k renormalization, dense layers chosen by
`decoder_sparse_step` / `mlp_only_layers`, sliding window only when `use_sliding_window`."""
from __future__ import annotations

from typing import Any

from moemesh.config import ModelConfig, common_fields
from moemesh.models.architecture import ArchitectureSpec
from moemesh.models.decoder import MoeDecoderLM, WeightNames


class Qwen3MoeForCausalLM(MoeDecoderLM):
    names = WeightNames(router="model.layers.{layer}.mlp.gate.weight", dense_mlp="model.layers.{layer}.mlp", qk_norm=True)


def parse_config(raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    fields = common_fields(raw, generation)
    if not raw.get("use_sliding_window", False):
        fields["sliding_window"] = None
    return ModelConfig(
        **fields,
        qk_norm=True,
        num_experts=int(raw.get("num_experts") or raw.get("num_local_experts") or 0),
        top_k=int(raw.get("num_experts_per_tok", 8)),
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 0)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        decoder_sparse_step=int(raw.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(l) for l in raw.get("mlp_only_layers") or ()),
    )


ARCHITECTURE = ArchitectureSpec("Qwen3MoeForCausalLM", parse_config, Qwen3MoeForCausalLM)
