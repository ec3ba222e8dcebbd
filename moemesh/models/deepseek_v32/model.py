"""DeepseekV32ForCausalLM (DeepSeek-V3.2) and GlmMoeDsaForCausalLM (GLM-5): DeepSeek-V3 (MLA, dense first
layers, grouped sigmoid gate with shared experts) with DSA attention (attention.py, indexer.py).

Shape legend: T tokens, H hidden.
"""
from __future__ import annotations

import torch
from torch import Tensor

from moemesh.checkpoint import CheckpointReader
from moemesh.config import ModelConfig
from moemesh.models.batch import BatchMeta
from moemesh.models.deepseek_v3.config import MLAConfig
from moemesh.models.deepseek_v3.mla import LatentCache
from moemesh.models.deepseek_v3.model import DeepseekV3ForCausalLM, load_mla
from moemesh.models.deepseek_v32.attention import DSAStep, DSAWeights, dsa_attention
from moemesh.models.deepseek_v32.config import DSAConfig, mla_config
from moemesh.models.deepseek_v32.indexer import load_indexer


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2 and GLM-5 (they differ in the indexer's rope layout and GLM-5's shared layers)."""

    def __init__(self, cfg: ModelConfig, reader: CheckpointReader, dtype: torch.dtype, dense_dtype: str | None = None) -> None:
        self.dsa = DSAConfig.from_model_config(cfg)
        super().__init__(cfg, reader, dtype, dense_dtype)
        self.slot_width = self.mla.kv_lora_rank + self.mla.qk_rope_head_dim + self.dsa.index_head_dim

    def mla_config(self, cfg: ModelConfig) -> MLAConfig:
        return mla_config(cfg.raw)

    def load_attention(self, reader: CheckpointReader, prefix: str, layer: int) -> DSAWeights:
        mla, dsa = self.mla, self.dsa
        indexer = None
        if dsa.indexer_types[layer] == "full":
            indexer = load_indexer(
                reader, f"{prefix}.indexer", self.cfg.hidden_size, mla.q_lora_rank, dsa.index_n_heads,
                dsa.index_head_dim, mla.qk_rope_head_dim, dsa.interleaved_rope, self.dtype,
            )
        return DSAWeights(load_mla(reader, prefix, self.cfg, mla, self.dtype, self.dense_dtype), indexer)

    def begin_step(self, meta: BatchMeta) -> DSAStep:
        return DSAStep.begin(meta, self.dsa.index_topk)

    def attend(self, h: Tensor, w: DSAWeights, meta: BatchMeta, kv_pair: tuple[Tensor, Tensor], carry: DSAStep) -> Tensor:
        cache = LatentCache(kv_pair[0], kv_pair[1], self.slot_width)
        return dsa_attention(h, w, meta, self.rope, cache, carry)
