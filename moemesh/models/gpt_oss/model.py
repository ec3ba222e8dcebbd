"""GptOssForCausalLM: sink attention (sliding or full per layer, see sinks_attention.py), YaRN rope,
a biased top-k-softmax router, and experts with biases and the clamped SwiGLU, reached through the
`ExpertCompute` seam (loaded by experts.py).

Shape legend: T tokens, H hidden, E experts, V vocab, R logits rows, NH heads, KVH kv heads, D head dim.
`forward_stages` yields once per layer while its experts compute (micro-batch ping-pong).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, Sequence

import torch
from torch import Tensor

from moemesh.checkpoint import CheckpointReader
from moemesh.checkpoint.progress import load_layers
from moemesh.config import ModelConfig
from moemesh.models.batch import BatchMeta
from moemesh.models.deepseek_v3.config import rope_parameters
from moemesh.models.deepseek_v3.decoder import tensors_of
from moemesh.models.deepseek_v3.yarn_rope import build_rotary_table
from moemesh.models.gpt_oss.config import layer_types, sliding_window
from moemesh.models.gpt_oss.router import topk_softmax_router
from moemesh.models.gpt_oss.sinks_attention import SinkAttentionWeights, sink_attention
from kernels.prepare import check_dense_dtype
from moemesh.models.layers import held_bytes, linear, matmul_layout, rms_norm
from moemesh.moe.dispatch import make_plan
from moemesh.moe.expert_compute import ExpertCompute, expert_output
from moemesh.contracts.knobs import MoeKnobs
from moemesh.models.stages import run_to_end


@dataclass(frozen=True)
class GptOssLayer:
    input_norm: Tensor  # [H]
    attn: SinkAttentionWeights
    post_norm: Tensor  # [H]
    router: Tensor  # [E, H]
    router_bias: Tensor  # [E]


class GptOssForCausalLM:
    """Non-expert weights of a gpt-oss model; experts are reached through an ExpertCompute."""

    def __init__(self, cfg: ModelConfig, reader: CheckpointReader, dtype: torch.dtype, dense_dtype: str | None = None) -> None:
        check_dense_dtype(dense_dtype)
        self.cfg = cfg
        self.dtype = dtype
        self.dense_dtype = dense_dtype  # the attention projections and LM head held in it (`matmul_layout`)
        self.layer_types = layer_types(cfg)
        self.window = sliding_window(cfg)
        h, v = cfg.hidden_size, cfg.vocab_size
        self.embed = reader.get("model.embed_tokens.weight", shape=(v, h), dtype=dtype)  # [V, H]
        self.layers: list[GptOssLayer] = load_layers(cfg.num_layers, lambda layer: self._load_layer(reader, layer))
        self.norm = reader.get("model.norm.weight", shape=(h,), dtype=dtype)
        tied = cfg.tie_word_embeddings or not reader.has("lm_head.weight")
        self.lm_head = self.embed if tied else reader.get("lm_head.weight", shape=(v, h), dtype=dtype)  # [V, H]
        if dense_dtype is not None:  # its own quantized copy (tied: the embedding stays, it is indexed)
            self.lm_head = matmul_layout(self.lm_head, dense_dtype=dense_dtype)
        self.rope = build_rotary_table(rope_parameters(cfg.raw), cfg.head_dim, cfg.max_position_embeddings)

    def _load_layer(self, reader: CheckpointReader, layer: int) -> GptOssLayer:
        cfg, dt, p = self.cfg, self.dtype, f"model.layers.{layer}"
        h, d, nh, kvh, e = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.num_experts
        a = f"{p}.self_attn"

        def get(name: str, shape: tuple[int, ...]) -> Tensor:
            return reader.get(name, shape=shape, dtype=dt)

        def bias(name: str, n: int) -> Tensor | None:
            return get(f"{a}.{name}.bias", (n,)) if reader.has(f"{a}.{name}.bias") else None

        qkv_bias = None
        if reader.has(f"{a}.q_proj.bias"):
            qkv_bias = torch.cat([bias("q_proj", nh * d), bias("k_proj", kvh * d), bias("v_proj", kvh * d)])
        qkv = torch.cat([get(f"{a}.q_proj.weight", (nh * d, h)), get(f"{a}.k_proj.weight", (kvh * d, h)),
                         get(f"{a}.v_proj.weight", (kvh * d, h))])
        o = get(f"{a}.o_proj.weight", (h, nh * d))
        if self.dense_dtype is not None:
            qkv, o = matmul_layout(qkv, dense_dtype=self.dense_dtype), matmul_layout(o, dense_dtype=self.dense_dtype)
        attn = SinkAttentionWeights(
            qkv=qkv,
            qkv_bias=qkv_bias,
            o=o,
            o_bias=bias("o_proj", h),
            sinks=reader.get(f"{a}.sinks", shape=(nh,), dtype=torch.float32),
            num_heads=nh,
            num_kv_heads=kvh,
            head_dim=d,
            window=self.window if self.layer_types[layer] == "sliding_attention" else None,
        )
        return GptOssLayer(
            input_norm=get(f"{p}.input_layernorm.weight", (h,)),
            attn=attn,
            post_norm=get(f"{p}.post_attention_layernorm.weight", (h,)),
            router=get(f"{p}.mlp.router.weight", (e, h)),
            router_bias=get(f"{p}.mlp.router.bias", (e,)),
        )

    def weight_bytes(self) -> int:
        """Bytes of non-expert weights read per decode step (embedding rows excluded, LM head included)."""
        tensors = [self.lm_head, self.norm]
        for lyr in self.layers:
            tensors += [lyr.input_norm, lyr.post_norm, lyr.router, lyr.router_bias, *tensors_of(lyr.attn)]
        return sum(held_bytes(t) for t in tensors)

    def forward_stages(
        self, meta: BatchMeta, kv_caches: Sequence[tuple[Tensor, Tensor]], experts: ExpertCompute, knobs: MoeKnobs
    ) -> Generator[None, None, Tensor]:
        """Yields once per layer (after submitting to the experts); returns logits [R, V] float32."""
        cfg = self.cfg
        x = self.embed[meta.input_ids]  # [T, H]
        for idx, lyr in enumerate(self.layers):
            h = rms_norm(x, lyr.input_norm, cfg.rms_norm_eps)
            k_cache, v_cache = kv_caches[idx]
            x = x + sink_attention(h, lyr.attn, meta, self.rope, k_cache, v_cache)
            h = rms_norm(x, lyr.post_norm, cfg.rms_norm_eps)  # [T, H]
            lk = knobs.for_layer(idx)
            routing = topk_softmax_router(h, lyr.router, lyr.router_bias, lk.top_k or cfg.top_k)  # [T, K]
            plan = make_plan(routing, cfg.num_experts, lk.capacity_factor)
            submitted = experts.submit(idx, h, plan)
            yield
            x = x + expert_output(submitted)  # [T, H]
        h = rms_norm(meta.logits_rows_of(x), self.norm, cfg.rms_norm_eps)  # [R, H]
        if self.dense_dtype is not None:
            return linear(h, self.lm_head).float()  # [R, V]
        return (h @ self.lm_head.t()).float()  # [R, V]

    def forward(self, meta: BatchMeta, kv_caches, experts: ExpertCompute, knobs: MoeKnobs) -> Tensor:
        """Runs forward_stages to the end (one micro-batch); returns logits [R, V]."""
        return run_to_end(self.forward_stages(meta, kv_caches, experts, knobs))
