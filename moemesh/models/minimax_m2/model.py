"""MiniMaxM2ForCausalLM: MiniMax-M2 attention (attention.py) and, in every layer, a sigmoid router with a
selection bias over routed experts (Mixtral's expert layout on disk: block_sparse_moe.experts.J.w1/w3/w2),
run by the grouped-gate decoder with one group and no shared experts.

Shape legend: T tokens, H hidden.
"""
from __future__ import annotations

import torch
from torch import Tensor

from moemesh.checkpoint import CheckpointReader
from moemesh.config import ModelConfig
from moemesh.models.batch import BatchMeta
from moemesh.models.deepseek_v3.config import GroupedGateConfig
from moemesh.models.deepseek_v3.decoder import GroupedGateDecoderLM
from moemesh.models.deepseek_v3.moe import GateNames
from moemesh.models.minimax_m2.attention import MiniMaxAttention, MiniMaxAttentionWeights
from moemesh.models.minimax_m2.config import GATE


class MiniMaxM2ForCausalLM(GroupedGateDecoderLM):
    gate_names = GateNames(
        router="model.layers.{layer}.block_sparse_moe.gate.weight",
        correction_bias="model.layers.{layer}.block_sparse_moe.e_score_correction_bias",
        shared_experts="",
        router_fp32=False,  # transformers computes MiniMax-M2's router logits in the model's dtype
    )

    def __init__(self, cfg: ModelConfig, reader: CheckpointReader, dtype: torch.dtype, dense_dtype: str | None = None) -> None:
        self.attention = MiniMaxAttention(cfg, dtype, dense_dtype)
        super().__init__(cfg, reader, dtype, dense_dtype)

    def gate_config(self, cfg: ModelConfig) -> GroupedGateConfig:
        return GATE

    def load_attention(self, reader: CheckpointReader, prefix: str, layer: int) -> MiniMaxAttentionWeights:
        return self.attention.load(reader, prefix)

    def attend(self, h: Tensor, w: MiniMaxAttentionWeights, meta: BatchMeta, kv_pair: tuple[Tensor, Tensor], carry=None) -> Tensor:
        return self.attention(h, w, meta, kv_pair)
