"""DeepseekV3ForCausalLM (DeepSeek-V3, Kimi-K2): MLA attention over a latent KV cache, YaRN rope,
dense first layers, then grouped-sigmoid-gate MoE layers with shared experts.

Shape legend: T tokens, H hidden, V vocab, R logits rows.
`forward_stages` yields once per MoE layer while its routed experts compute (micro-batch ping-pong).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, Sequence

import torch
from torch import Tensor

from moemesh.checkpoint import CheckpointReader
from moemesh.checkpoint.progress import load_progress
from moemesh.config import ModelConfig
from moemesh.models.batch import BatchMeta
from moemesh.models.deepseek_v3.config import GroupedGateConfig, MLAConfig
from moemesh.models.deepseek_v3.mla import LatentCache, MLAWeights, mla_attention
from moemesh.models.deepseek_v3.moe import DenseMLP, GroupedMoE, load_dense_mlp, load_grouped_moe, moe_block
from moemesh.models.deepseek_v3.yarn_rope import build_rotary_table, mla_softmax_scale
from moemesh.models.layers import rms_norm
from moemesh.moe.expert_compute import ExpertCompute
from moemesh.moe.knobs import MoeKnobs


@dataclass(frozen=True)
class DeepseekLayer:
    input_norm: Tensor  # [H]
    attn: MLAWeights
    post_norm: Tensor  # [H]
    mlp: DenseMLP | GroupedMoE


def load_mla(reader: CheckpointReader, prefix: str, cfg: ModelConfig, mla: MLAConfig, dtype: torch.dtype) -> MLAWeights:
    h, nh = cfg.hidden_size, cfg.num_heads
    r, dr = mla.kv_lora_rank, mla.qk_rope_head_dim

    def get(name, shape, bias=False):
        full = f"{prefix}.{name}.{'bias' if bias else 'weight'}"
        if bias and not reader.has(full):
            return None
        return reader.get(full, shape=shape, dtype=dtype)

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


class DeepseekV3ForCausalLM:
    """Non-expert weights of a DeepSeek-V3-family model; routed experts are reached through an ExpertCompute."""

    def __init__(self, cfg: ModelConfig, reader: CheckpointReader, dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.mla = MLAConfig.from_raw(cfg.raw)
        self.gate = GroupedGateConfig.from_raw(cfg.raw)
        h, v = cfg.hidden_size, cfg.vocab_size
        self.embed = reader.get("model.embed_tokens.weight", shape=(v, h), dtype=dtype)  # [V, H]
        self.layers: list[DeepseekLayer] = []
        with load_progress(cfg.num_layers, "loading layers") as bar:
            for layer in range(cfg.num_layers):
                self.layers.append(self._load_layer(reader, layer))
                bar.update(1)
        self.norm = reader.get("model.norm.weight", shape=(h,), dtype=dtype)
        tied = cfg.tie_word_embeddings or not reader.has("lm_head.weight")
        self.lm_head = self.embed if tied else reader.get("lm_head.weight", shape=(v, h), dtype=dtype)  # [V, H]
        self.rope = build_rotary_table(self.mla.rope, self.mla.qk_rope_head_dim, cfg.max_position_embeddings)

    def _load_layer(self, reader: CheckpointReader, layer: int) -> DeepseekLayer:
        cfg, dt, p = self.cfg, self.dtype, f"model.layers.{layer}"
        if cfg.is_moe_layer(layer):
            mlp = load_grouped_moe(reader, layer, cfg, self.gate, dt)
        else:
            mlp = load_dense_mlp(reader, f"{p}.mlp", cfg.hidden_size, cfg.intermediate_size, dt)
        return DeepseekLayer(
            input_norm=reader.get(f"{p}.input_layernorm.weight", shape=(cfg.hidden_size,), dtype=dt),
            attn=load_mla(reader, f"{p}.self_attn", cfg, self.mla, dt),
            post_norm=reader.get(f"{p}.post_attention_layernorm.weight", shape=(cfg.hidden_size,), dtype=dt),
            mlp=mlp,
        )

    def weight_bytes(self) -> int:
        """Bytes of non-expert weights read per decode step (embedding rows excluded, LM head included)."""
        tensors = [self.lm_head, self.norm]
        for lyr in self.layers:
            tensors += [lyr.input_norm, lyr.post_norm]
            tensors += [t for t in vars(lyr.attn).values() if isinstance(t, Tensor)]
            mlp = lyr.mlp
            if isinstance(mlp, GroupedMoE):
                tensors += [mlp.router] + ([mlp.shared.gate_up, mlp.shared.down] if mlp.shared else [])
            else:
                tensors += [mlp.gate_up, mlp.down]
        return sum(t.numel() * t.element_size() for t in tensors)

    def forward_stages(
        self, meta: BatchMeta, kv_caches: Sequence[tuple[Tensor, Tensor]], experts: ExpertCompute, knobs: MoeKnobs
    ) -> Generator[None, None, Tensor]:
        """Yields once per MoE layer (after submitting to the experts); returns logits [R, V] float32."""
        cfg = self.cfg
        latent = self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        x = self.embed[meta.input_ids]  # [T, H]
        for idx, lyr in enumerate(self.layers):
            h = rms_norm(x, lyr.input_norm, cfg.rms_norm_eps)
            k_cache, v_cache = kv_caches[idx]
            x = x + mla_attention(h, lyr.attn, meta, self.rope, LatentCache(k_cache, v_cache, latent))
            h = rms_norm(x, lyr.post_norm, cfg.rms_norm_eps)  # [T, H]
            if isinstance(lyr.mlp, DenseMLP):
                x = x + lyr.mlp(h)
            else:
                x = x + (yield from moe_block(h, idx, lyr.mlp, cfg, self.gate, knobs.for_layer(idx), experts))
        h = rms_norm(x[meta.logits_idx], self.norm, cfg.rms_norm_eps)  # [R, H]
        return (h @ self.lm_head.t()).float()  # [R, V]

    def forward(self, meta: BatchMeta, kv_caches, experts: ExpertCompute, knobs: MoeKnobs) -> Tensor:
        """Runs forward_stages to the end (one micro-batch); returns logits [R, V]."""
        stages = self.forward_stages(meta, kv_caches, experts, knobs)
        while True:
            try:
                next(stages)
            except StopIteration as done:
                return done.value
