"""MixtralForCausalLM: softmax top-k gate that always renormalizes, experts w1 (gate) / w3 (up) / w2 (down)."""
from __future__ import annotations

from typing import Any

from moemesh.config import ModelConfig, common_fields
from moemesh.models.architecture import ArchitectureSpec
from moemesh.models.decoder import MoeDecoderLM, WeightNames


class MixtralForCausalLM(MoeDecoderLM):
    names = WeightNames(router="model.layers.{layer}.block_sparse_moe.gate.weight", dense_mlp="", qk_norm=False)


def parse_config(raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    fields = common_fields(raw, generation)
    inter = int(raw["intermediate_size"])
    return ModelConfig(
        **fields,
        num_experts=int(raw.get("num_local_experts", 8)),
        top_k=int(raw.get("num_experts_per_tok", 2)),
        moe_intermediate_size=inter,
        norm_topk_prob=True,
    )


ARCHITECTURE = ArchitectureSpec("MixtralForCausalLM", parse_config, MixtralForCausalLM)
