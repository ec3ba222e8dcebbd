"""DeepseekV3ForCausalLM (DeepSeek-V3, Kimi-K2): MLA attention over a latent KV cache, YaRN rope,
dense first layers, then grouped-sigmoid-gate MoE layers with shared experts (see decoder.py, moe.py).

Shape legend: T tokens, H hidden, NH heads, R kv_lora_rank, Dr rope dims.
"""
from __future__ import annotations

import torch
from torch import Tensor

from moemesh.checkpoint import CheckpointReader
from moemesh.config import ModelConfig
from moemesh.models.batch import BatchMeta
from moemesh.models.deepseek_v3.config import MLAConfig
from moemesh.models.deepseek_v3.decoder import GroupedGateDecoderLM
from moemesh.models.deepseek_v3.mla import LatentCache, MLAWeights, mla_attention
from moemesh.models.deepseek_v3.yarn_rope import build_rotary_table, mla_softmax_scale
from moemesh.models.layers import as_tensor, matmul_layout


def load_mla(
    reader: CheckpointReader, prefix: str, cfg: ModelConfig, mla: MLAConfig, dtype: torch.dtype, dense_dtype: str | None = None
) -> MLAWeights:
    """One layer's MLA weights; with dense_dtype its projections but kv_b held in that format (see MLAWeights)."""
    h, nh = cfg.hidden_size, cfg.num_heads
    r, dr = mla.kv_lora_rank, mla.qk_rope_head_dim

    def get(name, shape, bias=False):
        full = f"{prefix}.{name}.{'bias' if bias else 'weight'}"
        if bias and not reader.has(full):
            return None
        w = reader.get(full, shape=shape, dtype=dtype)
        if bias or name.endswith("layernorm"):
            return w
        if name == "kv_b_proj":  # absorbed per head: stays a plain tensor (dequantized if stored FP8)
            return as_tensor(w, dtype)
        return matmul_layout(w, dense_dtype=dense_dtype) if dense_dtype is not None else w

    q_parts = {}
    if mla.q_lora_rank is None:
        q_parts["q"] = get("q_proj", (nh * mla.qk_head_dim, h))
    else:
        rq = mla.q_lora_rank
        q_parts.update(
            q_a=get("q_a_proj", (rq, h)),
            q_a_bias=get("q_a_proj", (rq,), bias=True),
            q_a_norm=get("q_a_layernorm", (rq,)),
            q_b=get("q_b_proj", (nh * mla.qk_head_dim, rq)),
        )
    return MLAWeights(
        num_heads=nh,
        kv_lora_rank=r,
        qk_nope_head_dim=mla.qk_nope_head_dim,
        qk_rope_head_dim=dr,
        v_head_dim=mla.v_head_dim,
        softmax_scale=mla_softmax_scale(mla.qk_head_dim, mla.rope),
        rope_interleave=mla.rope_interleave,
        kv_a=get("kv_a_proj_with_mqa", (r + dr, h)),
        kv_a_bias=get("kv_a_proj_with_mqa", (r + dr,), bias=True),
        kv_a_norm=get("kv_a_layernorm", (r,)),
        kv_b=get("kv_b_proj", (nh * (mla.qk_nope_head_dim + mla.v_head_dim), r)),
        o=get("o_proj", (h, nh * mla.v_head_dim)),
        o_bias=get("o_proj", (h,), bias=True),
        **q_parts,
    )


class DeepseekV3ForCausalLM(GroupedGateDecoderLM):
    """DeepSeek-V3 / Kimi-K2: MLA attention over the latent cache."""

    def __init__(self, cfg: ModelConfig, reader: CheckpointReader, dtype: torch.dtype, dense_dtype: str | None = None) -> None:
        self.mla = self.mla_config(cfg)
        super().__init__(cfg, reader, dtype, dense_dtype)
        self.rope = build_rotary_table(self.mla.rope, self.mla.qk_rope_head_dim, cfg.max_position_embeddings)

    def mla_config(self, cfg: ModelConfig) -> MLAConfig:
        return MLAConfig.from_raw(cfg.raw)

    def load_attention(self, reader: CheckpointReader, prefix: str, layer: int) -> MLAWeights:
        return load_mla(reader, prefix, self.cfg, self.mla, self.dtype, self.dense_dtype)

    def attend(self, h: Tensor, w: MLAWeights, meta: BatchMeta, kv_pair: tuple[Tensor, Tensor], carry=None) -> Tensor:
        cache = LatentCache(kv_pair[0], kv_pair[1], w.latent_dim)
        return mla_attention(h, w, meta, self.rope, cache)
