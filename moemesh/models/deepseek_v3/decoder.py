"""The decoder loop shared by the grouped-gate families (DeepSeek-V3 / Kimi-K2 and GLM-4.5 MoE):
embeddings, per layer attention then a dense MLP (first `first_k_dense_replace` layers) or the MoE
block with shared experts, final norm, LM head. Each family supplies its attention.

Shape legend: T tokens, H hidden, V vocab, R logits rows.
`forward_stages` yields once per MoE layer while its routed experts compute (micro-batch ping-pong).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Callable, Generator, Sequence

import torch
from torch import Tensor

from moemesh.checkpoint import CheckpointReader
from moemesh.checkpoint.progress import load_layers
from moemesh.config import ModelConfig
from moemesh.models.batch import BatchMeta
from moemesh.models.deepseek_v3.config import GroupedGateConfig
from moemesh.checkpoint.fp8_dequant import weights_reader
from moemesh.models.deepseek_v3.moe import DenseMLP, GateNames, GroupedMoE, load_dense_mlp, load_grouped_moe, moe_block
from kernels.prepare import check_dense_dtype
from moemesh.models.layers import as_tensor, held_bytes, linear, matmul_layout, rms_norm
from moemesh.moe.expert_compute import ExpertCompute
from moemesh.contracts.knobs import MoeKnobs
from moemesh.models.stages import run_to_end

# attend(h [T, H], weights, meta, (k_cache, v_cache), carry) -> [T, H]
Attend = Callable[[Tensor, Any, BatchMeta, tuple[Tensor, Tensor], Any], Tensor]


@dataclass(frozen=True)
class Layer:
    input_norm: Tensor  # [H]
    attn: Any  # the family's attention weights
    post_norm: Tensor  # [H]
    mlp: DenseMLP | GroupedMoE


def tensors_of(obj: Any) -> list[Tensor]:
    """The tensors a weights dataclass was built from (init fields, nested weights dataclasses included;
    derived copies excluded), for byte counts."""
    found: list[Tensor] = []
    for f in fields(obj):
        value = getattr(obj, f.name) if f.init else None
        if isinstance(value, Tensor):
            found.append(value)
        elif is_dataclass(value):
            found += tensors_of(value)
    return found


class GroupedGateDecoderLM:
    """Non-expert weights of a grouped-gate MoE model; routed experts are reached through an ExpertCompute.
    A family names its gate tensors in `gate_names` and may override `gate_config`.

    Subclasses load their attention (`load_attention(reader, prefix, layer) -> weights`) and run it
    (`attend(h, weights, meta, kv_pair, carry) -> [T, H]`); `carry` is what `begin_step(meta)` made for
    this forward pass, handed from layer to layer (DSA: the top-k selection that later layers reuse).
    dense_dtype (`EngineConfig.dense_dtype`): the dense-MLP and shared-expert matrices and the LM head
    are held in it here, the attention by each family's loader (`self.dense_dtype`); the embedding,
    routers and norms stay in the compute dtype."""

    gate_names = GateNames()

    def __init__(self, cfg: ModelConfig, reader: CheckpointReader, dtype: torch.dtype, dense_dtype: str | None = None) -> None:
        check_dense_dtype(dense_dtype)
        # BlockwiseFP8 non-expert weights are dequantized at load, or kept as stored for dense_dtype "fp8"
        reader = weights_reader(reader, cfg.raw, dense_dtype)
        self.cfg = cfg
        self.dtype = dtype
        self.dense_dtype = dense_dtype
        self.gate = self.gate_config(cfg)
        h, v = cfg.hidden_size, cfg.vocab_size
        self.embed = as_tensor(reader.get("model.embed_tokens.weight", shape=(v, h), dtype=dtype), dtype)  # [V, H]
        self.layers: list[Layer] = load_layers(cfg.num_layers, lambda layer: self._load_layer(reader, layer))
        self.norm = reader.get("model.norm.weight", shape=(h,), dtype=dtype)
        tied = cfg.tie_word_embeddings or not reader.has("lm_head.weight")
        self.lm_head = self.embed if tied else reader.get("lm_head.weight", shape=(v, h), dtype=dtype)  # [V, H]
        if dense_dtype is not None:  # its own quantized copy (tied: the embedding stays, it is indexed)
            self.lm_head = matmul_layout(self.lm_head, dense_dtype=dense_dtype)

    def _load_layer(self, reader: CheckpointReader, layer: int) -> Layer:
        cfg, dt, p = self.cfg, self.dtype, f"model.layers.{layer}"
        if cfg.is_moe_layer(layer):
            mlp = load_grouped_moe(reader, layer, cfg, self.gate, dt, self.gate_names, self.dense_dtype)
        else:
            mlp = load_dense_mlp(reader, f"{p}.mlp", cfg.hidden_size, cfg.intermediate_size, dt, self.dense_dtype)
        return Layer(
            input_norm=reader.get(f"{p}.input_layernorm.weight", shape=(cfg.hidden_size,), dtype=dt),
            attn=self.load_attention(reader, f"{p}.self_attn", layer),
            post_norm=reader.get(f"{p}.post_attention_layernorm.weight", shape=(cfg.hidden_size,), dtype=dt),
            mlp=mlp,
        )

    def gate_config(self, cfg: ModelConfig) -> GroupedGateConfig:
        return GroupedGateConfig.from_raw(cfg.raw)

    def begin_step(self, meta: BatchMeta) -> Any:
        """Per-forward state the attention layers share (none by default)."""
        return None

    def weight_bytes(self) -> int:
        """Bytes of non-expert weights read per decode step (embedding rows excluded, LM head included)."""
        tensors = [self.lm_head, self.norm]
        for lyr in self.layers:
            tensors += [lyr.input_norm, lyr.post_norm, *tensors_of(lyr.attn), *tensors_of(lyr.mlp)]
        return sum(held_bytes(t) for t in tensors)

    def forward_stages(
        self, meta: BatchMeta, kv_caches: Sequence[tuple[Tensor, Tensor]], experts: ExpertCompute, knobs: MoeKnobs
    ) -> Generator[None, None, Tensor]:
        """Yields once per MoE layer (after submitting to the experts); returns logits [R, V] float32."""
        cfg = self.cfg
        x = self.embed[meta.input_ids]  # [T, H]
        carry = self.begin_step(meta)
        for idx, lyr in enumerate(self.layers):
            h = rms_norm(x, lyr.input_norm, cfg.rms_norm_eps)
            x = x + self.attend(h, lyr.attn, meta, kv_caches[idx], carry)
            h = rms_norm(x, lyr.post_norm, cfg.rms_norm_eps)  # [T, H]
            if isinstance(lyr.mlp, DenseMLP):
                x = x + lyr.mlp(h)
            else:
                x = x + (yield from moe_block(h, idx, lyr.mlp, cfg, self.gate, knobs.for_layer(idx), experts))
        h = rms_norm(meta.logits_rows_of(x), self.norm, cfg.rms_norm_eps)  # [R, H]
        if self.dense_dtype is not None:
            return linear(h, self.lm_head).float()  # [R, V]
        return (h @ self.lm_head.t()).float()  # [R, V]

    def forward(self, meta: BatchMeta, kv_caches, experts: ExpertCompute, knobs: MoeKnobs) -> Tensor:
        """Runs forward_stages to the end (one micro-batch); returns logits [R, V]."""
        return run_to_end(self.forward_stages(meta, kv_caches, experts, knobs))
