"""`LocalExperts`: the in-process `ExpertCompute`, holding every MoE layer's experts.

Shape legend: T tokens, H hidden.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from kernels.cpu.moe_mlp_cpu import kernel_view
from kernels.cpu.step_ops import DecodeExperts, decode_experts_weights
from moemesh.checkpoint import CheckpointReader
from moemesh.checkpoint.progress import load_progress
from moemesh.config import ModelConfig
from moemesh.moe.dispatch import DispatchPlan
from moemesh.moe.expert_loader import load_expert_weights
from moemesh.moe.layer_experts import LayerExperts, all_experts_path_by_default, pack_by_default


class LocalExperts:
    """layer -> `LayerExperts` holding all E experts of that layer (local index == logical id)."""

    def __init__(self, layers: Mapping[int, LayerExperts]) -> None:
        self.layers = dict(layers)
        # layer -> (the LayerExperts it was made for, its `DecodeExperts` or None)
        self._decode: dict[int, tuple[LayerExperts, DecodeExperts | None]] = {}

    @classmethod
    def from_checkpoint(
        cls, reader: CheckpointReader, cfg: ModelConfig, dtype: torch.dtype, experts_dtype: str | None = None,
        pack: bool | None = None, all_experts_path: bool = True,
    ) -> "LocalExperts":
        """Every MoE layer's experts from the checkpoint.
        pack: also hold a oneDNN-packed copy of the concatenated experts for calls that route every
        token to every expert (CPU: bfloat16, or float32 with >= 2 torch threads; a second copy of the
        weights); None = auto (`pack_by_default`: only when the model's own top-k is its number of
        experts). all_experts_path: False runs every call through `kernels.moe_mlp` (see `LayerExperts`);
        True holds the all-experts layout where it applies (`all_experts_path_by_default`: the model's
        own top-k is its number of experts)."""
        experts = list(range(cfg.num_experts))
        all_experts_path = all_experts_path and all_experts_path_by_default(cfg.top_k, cfg.num_experts)
        layers = {}
        with load_progress(len(cfg.moe_layers), "loading experts") as bar:
            for layer in cfg.moe_layers:
                w = load_expert_weights(reader, cfg, layer, experts, dtype, experts_dtype)
                layers[layer] = LayerExperts.hold(experts, w, all_experts_path)
                bar.update(1)
        cats = [lx.concatenated for lx in layers.values() if lx.concatenated is not None]
        if pack is None and cats:
            copy_bytes = sum(t.numel() * t.element_size() for c in cats for t in (c.gate_up, c.down))
            pack = pack_by_default(cfg.top_k, cfg.num_experts, cats[0].gate_up.dtype, cats[0].gate_up.device, copy_bytes)
        return cls({layer: lx.packed() for layer, lx in layers.items()} if pack else layers)

    def decode_kernels(self, layer: int) -> DecodeExperts | None:
        """The layer's experts as the compiled kernels' one-call decode layer reads them
        (`kernels.cpu.step_ops.decode_layers_experts`: the layer's plan computed as `submit` computes it),
        made on first use and again when the layer's experts or their projections are replaced; None
        where the kernels do not read them or the layer has no experts here."""
        experts = self.layers.get(layer)
        held = self._decode.get(layer)
        if held is None or held[0] is not experts or (held[1] is not None and kernel_view(experts.weights) is not held[1].view):
            held = (experts, decode_experts_weights(experts.weights) if experts is not None else None)
            self._decode[layer] = held
        return held[1]

    def submit(self, layer: int, x: Tensor, plan: DispatchPlan) -> Tensor:
        """x [T, H] -> [T, H], computed now (see `ExpertCompute`)."""
        experts = self.layers.get(layer)
        if experts is None:
            raise ValueError(f"layer {layer} has no experts loaded here")
        if plan.by_expert is not None:  # every token to every expert
            out = experts.every_expert(x, plan.by_expert)
            if out is not None:
                return out
            plan = plan.with_rows()
        return experts(x, plan.token_idx, plan.weights, plan.expert_ids, plan.counts)
