"""Glm4MoeForCausalLM (GLM-4.5, GLM-4.5-Air): GlmAttention (attention.py), dense first layers, then the
DeepSeek-style grouped sigmoid gate with shared experts (moemesh.models.deepseek_v3.decoder / moe).

Shape legend: T tokens, H hidden.
"""
from __future__ import annotations

import torch
from torch import Tensor

from moemesh.checkpoint import CheckpointReader
from moemesh.config import ModelConfig
from moemesh.models.attention import AttentionWeights
from moemesh.models.batch import BatchMeta
from moemesh.models.deepseek_v3.decoder import GroupedGateDecoderLM
from moemesh.models.glm4_moe.attention import GlmAttention


class Glm4MoeForCausalLM(GroupedGateDecoderLM):
    def __init__(self, cfg: ModelConfig, reader: CheckpointReader, dtype: torch.dtype, dense_dtype: str | None = None) -> None:
        self.attention = GlmAttention(cfg, dtype, dense_dtype)
        super().__init__(cfg, reader, dtype, dense_dtype)

    def load_attention(self, reader: CheckpointReader, prefix: str, layer: int) -> AttentionWeights:
        return self.attention.load(reader, prefix)

    def attend(self, h: Tensor, w: AttentionWeights, meta: BatchMeta, kv_pair: tuple[Tensor, Tensor], carry=None) -> Tensor:
        return self.attention(h, w, meta, kv_pair)
