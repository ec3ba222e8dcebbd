"""Qwen3NextForCausalLM / Qwen3_5MoeForCausalLM (and a Qwen3.5-MoE VL checkpoint's text model): layers
of Gated DeltaNet (gated_deltanet.py) or gated full attention (gated_attention.py), each followed by a
dense SwiGLU MLP or the MoE block with its gated shared expert (moe.py); zero-centred RMSNorms.

Shape legend: T tokens, H hidden, V vocab, R logits rows, D head dim.

Per-layer caches (`caches[layer]`): a (k, v) pair of the paged KV cache for full-attention layers, a
`LayerState` (the engine's recurrent-state slots) for linear-attention layers; `recurrent_state_spec`
says what the latter hold. `forward_stages` yields once per MoE layer while its routed experts compute.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator, Sequence

import torch
from torch import Tensor

from moemesh.checkpoint import CheckpointReader
from moemesh.checkpoint.progress import load_layers
from moemesh.config import ModelConfig
from moemesh.models.batch import BatchMeta
from moemesh.models.deepseek_v3.decoder import tensors_of
from kernels.prepare import check_dense_dtype
from moemesh.checkpoint.fp8_dequant import fp8_block_size, weights_reader
from moemesh.models.deepseek_v3.moe import DenseMLP, load_dense_mlp
from moemesh.models.layers import held_bytes, linear, matmul_layout, rope_for_step
from moemesh.models.partial_rope import permuted_rope
from moemesh.models.qwen3_next.config import HybridConfig
from moemesh.models.qwen3_next.gated_attention import GatedAttentionWeights, gated_attention, load_gated_attention
from moemesh.models.qwen3_next.gated_deltanet import DeltaNetWeights, gated_deltanet, load_deltanet
from moemesh.models.qwen3_next.moe import SparseMoE, load_sparse_moe, sparse_moe_block
from moemesh.models.qwen3_next.norms import scaled_rms_norm, zero_centered
from moemesh.models.recurrent_state import RecurrentStateSpec
from moemesh.models.stages import run_to_end
from moemesh.moe.expert_compute import ExpertCompute
from moemesh.contracts.knobs import MoeKnobs


@dataclass(frozen=True)
class HybridLayer:
    input_norm: Tensor  # [H] float32 (1 + w)
    mixer: DeltaNetWeights | GatedAttentionWeights
    post_norm: Tensor  # [H] float32 (1 + w)
    mlp: DenseMLP | SparseMoE


class Qwen3NextForCausalLM:
    """Non-expert weights of Qwen3-Next / Qwen3.5-MoE; routed experts are reached through an ExpertCompute."""

    # A prefix cache hit would skip the tokens whose recurrent state the sequence needs (the state after
    # a prefix is not kept per block), so these models run without it.
    supports_prefix_cache = False

    def __init__(self, cfg: ModelConfig, reader: CheckpointReader, dtype: torch.dtype, dense_dtype: str | None = None) -> None:
        check_dense_dtype(dense_dtype)
        if dense_dtype is not None and fp8_block_size(cfg.raw) is not None:
            # The gated attention splits each head's query and gate rows apart and the linear attention
            # regroups its input projections by head at load: rows move across the stored 128-row FP8
            # blocks, so a BlockwiseFP8 checkpoint's matrices could only be re-quantized, not kept.
            raise ValueError(
                f"dense_dtype {dense_dtype!r} is not supported for {cfg.architecture} on a BlockwiseFP8 checkpoint: its "
                "attention projections are re-laid by rows at load (unset dense_dtype; a float checkpoint quantizes)"
            )
        self.cfg, self.dtype, self.dense_dtype = cfg, dtype, dense_dtype
        reader = weights_reader(reader, cfg.raw)  # BlockwiseFP8 non-expert weights are dequantized at load
        self.hybrid = HybridConfig.from_model_config(cfg)
        rope = permuted_rope(cfg, self.hybrid.rotary_dim)
        self.perm, self.rope = rope.perm, rope.table  # [D], [P, D]
        h, v = cfg.hidden_size, cfg.vocab_size
        self.embed = reader.get("model.embed_tokens.weight", shape=(v, h), dtype=dtype)  # [V, H]
        self.layers: list[HybridLayer] = load_layers(cfg.num_layers, lambda layer: self._load_layer(reader, layer))
        self.norm = zero_centered(reader.get("model.norm.weight", shape=(h,), dtype=dtype))
        tied = cfg.tie_word_embeddings or not reader.has("lm_head.weight")
        self.lm_head = self.embed if tied else matmul_layout(reader.get("lm_head.weight", shape=(v, h), dtype=dtype))
        if dense_dtype is not None:  # its own quantized copy (tied: the embedding stays, it is indexed)
            self.lm_head = matmul_layout(self.embed if tied else self.lm_head, dense_dtype=dense_dtype)

    def _load_layer(self, reader: CheckpointReader, layer: int) -> HybridLayer:
        cfg, dt, p = self.cfg, self.dtype, f"model.layers.{layer}"
        h = cfg.hidden_size
        if self.hybrid.layer_types[layer] == "linear_attention":
            mixer = load_deltanet(reader, f"{p}.linear_attn", self.hybrid, h, cfg.rms_norm_eps, dt, self.dense_dtype)
        else:
            mixer = load_gated_attention(reader, f"{p}.self_attn", cfg, self.perm, dt, self.dense_dtype)
        if cfg.is_moe_layer(layer):
            mlp = load_sparse_moe(reader, f"{p}.mlp", cfg, self.hybrid.shared_expert_intermediate_size, dt, self.dense_dtype)
        else:
            dense = load_dense_mlp(reader, f"{p}.mlp", h, cfg.intermediate_size, dt)
            fmt = self.dense_dtype
            mlp = DenseMLP(matmul_layout(dense.gate_up, dense_dtype=fmt), matmul_layout(dense.down, dense_dtype=fmt))
        return HybridLayer(
            input_norm=zero_centered(reader.get(f"{p}.input_layernorm.weight", shape=(h,), dtype=dt)),
            mixer=mixer,
            post_norm=zero_centered(reader.get(f"{p}.post_attention_layernorm.weight", shape=(h,), dtype=dt)),
            mlp=mlp,
        )

    def recurrent_state_spec(self) -> RecurrentStateSpec:
        hc = self.hybrid
        return RecurrentStateSpec(
            layers=hc.linear_layers,
            conv_shape=(hc.conv_dim, hc.conv_kernel - 1),
            ssm_shape=(hc.linear_num_value_heads, hc.linear_key_head_dim, hc.linear_value_head_dim),
        )

    def weight_bytes(self) -> int:
        """Bytes of non-expert weights read per decode step (embedding rows excluded, LM head included)."""
        tensors = [self.lm_head, self.norm]
        for lyr in self.layers:
            tensors += [lyr.input_norm, lyr.post_norm, *tensors_of(lyr.mixer), *tensors_of(lyr.mlp)]
        return sum(held_bytes(t) for t in tensors)

    def forward_stages(
        self, meta: BatchMeta, caches: Sequence[Any], experts: ExpertCompute, knobs: MoeKnobs
    ) -> Generator[None, None, Tensor]:
        """Yields once per MoE layer (after submitting to the experts); returns logits [R, V] float32."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        x = self.embed[meta.input_ids]  # [T, H]
        rope_cs = rope_for_step(self.rope, meta.positions, self.dtype)  # [T, 1, D], shared by the attention layers
        for idx, lyr in enumerate(self.layers):
            h = scaled_rms_norm(x, lyr.input_norm, eps)
            if isinstance(lyr.mixer, DeltaNetWeights):
                x = x + gated_deltanet(h, lyr.mixer, meta, caches[idx])
            else:
                k_cache, v_cache = caches[idx]
                x = x + gated_attention(h, lyr.mixer, meta, rope_cs, k_cache, v_cache)
            h = scaled_rms_norm(x, lyr.post_norm, eps)  # [T, H]
            if isinstance(lyr.mlp, DenseMLP):
                x = x + lyr.mlp(h)
            else:
                x = x + (yield from sparse_moe_block(h, idx, lyr.mlp, cfg, knobs.for_layer(idx), experts))
        h = scaled_rms_norm(meta.logits_rows_of(x), self.norm, eps)  # [R, H]
        return linear(h, self.lm_head).float()  # [R, V]

    def forward(self, meta: BatchMeta, caches, experts: ExpertCompute, knobs: MoeKnobs) -> Tensor:
        """Runs forward_stages to the end (one micro-batch); returns logits [R, V]."""
        return run_to_end(self.forward_stages(meta, caches, experts, knobs))
