"""`LocalExperts`: the in-process `ExpertCompute`, holding every MoE layer's experts.

Shape legend: N rows grouped by expert, G experts with rows, E experts held, H hidden, I intermediate.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Iterable, Mapping

import psutil
import torch
from torch import Tensor

from kernels import ExpertWeights, grouped_expert_mlp
from kernels.experts import apply_activation
from moemesh.checkpoint import CheckpointReader
from moemesh.config import ModelConfig
from moemesh.checkpoint.progress import load_progress
from moemesh.models.layers import packing_applies
from moemesh.moe.all_experts import ConcatenatedExperts
from moemesh.moe.expert_compute import completed
from moemesh.moe.expert_loader import load_expert_weights


AUTO_PACK_MEMORY_SHARE = 0.25


def pack_by_default(concatenated: Iterable[ConcatenatedExperts]) -> bool:
    """Whether to hold the packed copy when not told: on the CPU, where packing applies, and when the
    copy takes at most AUTO_PACK_MEMORY_SHARE of the memory available now."""
    cats = list(concatenated)
    if not cats or not packing_applies(cats[0].gate_up.dtype, cats[0].gate_up.device):
        return False
    copy_bytes = sum(t.numel() * t.element_size() for c in cats for t in (c.gate_up, c.down))
    return copy_bytes <= AUTO_PACK_MEMORY_SHARE * psutil.virtual_memory().available


class LocalExperts:
    """Runs `kernels.grouped_expert_mlp` on weights held in this process (layer -> all E experts).
    When every expert in a call gets the same number of rows and the weights are dense in the compute
    dtype, one batched matmul per projection replaces the grouped path. Dense experts are also held in
    the concatenated layout of `ConcatenatedExperts` (their `down` re-viewed from it, no second copy),
    so `submit_all` (every token to every expert) is two plain matmuls.
    pack: also hold a oneDNN-packed copy of the concatenated experts for `submit_all` (on the CPU:
    bfloat16, or float32 with >= 2 torch threads; memory for speed: a second copy of the expert
    weights). None = auto: pack when the copy takes at most `AUTO_PACK_MEMORY_SHARE` of the memory
    available now (`pack_by_default`)."""

    def __init__(self, weights: Mapping[int, ExpertWeights], pack: bool | None = None) -> None:
        self.weights: dict[int, ExpertWeights] = {}
        self.concatenated: dict[int, ConcatenatedExperts] = {}
        for layer, w in weights.items():
            adopted = ConcatenatedExperts.adopt(w)
            if adopted is None:
                self.weights[layer] = w
            else:
                self.concatenated[layer], self.weights[layer] = adopted
        if pack is None:
            pack = pack_by_default(self.concatenated.values())
        if pack:
            for layer, cat in self.concatenated.items():
                self.concatenated[layer] = cat.packed() or cat

    @classmethod
    def from_checkpoint(
        cls, reader: CheckpointReader, cfg: ModelConfig, dtype: torch.dtype, experts_dtype: str | None = None,
        pack: bool | None = None,
    ) -> "LocalExperts":
        layers = cfg.moe_layers
        all_experts = list(range(cfg.num_experts))
        weights = {}
        with load_progress(len(layers), "loading experts") as bar:
            for layer in layers:
                weights[layer] = load_expert_weights(reader, cfg, layer, all_experts, dtype, experts_dtype)
                bar.update(1)
        return cls(weights, pack)

    def submit(self, layer: int, x: Tensor, expert_ids: Tensor, counts: Tensor) -> Future:
        w = self.weights.get(layer)
        if w is None:
            raise ValueError(f"layer {layer} has no experts loaded here")
        if x.shape[0] == 0:
            return completed(torch.empty_like(x))
        rows = counts.tolist()
        if len(rows) > 1 and min(rows) == max(rows) and is_dense(w, x.dtype):
            return completed(batched_mlp(x, expert_ids, rows[0], w))
        return completed(grouped_expert_mlp(x, expert_ids, counts, w))

    def submit_all(self, layer: int, x: Tensor, weights: Tensor) -> Future | None:
        """x [T, H], weights [T, E] -> Future of [T, H], the gate-weighted sum over all E experts;
        None when this layer's experts are not dense in x.dtype (the caller then dispatches rows)."""
        cat = self.concatenated.get(layer)
        if cat is None or cat.gate_up.dtype != x.dtype or weights.shape[-1] != cat.num_experts:
            return None
        return completed(cat.mlp(x, weights))


def is_dense(w: ExpertWeights, dtype: torch.dtype) -> bool:
    """Plain tensors already in the compute dtype, no biases (quantized formats go through kernels)."""
    return (
        isinstance(w.gate_up, Tensor)
        and isinstance(w.down, Tensor)
        and w.gate_up.dtype == dtype
        and w.down.dtype == dtype
        and w.gate_up_bias is None
        and w.down_bias is None
    )


def batched_mlp(x: Tensor, expert_ids: Tensor, rows: int, w: ExpertWeights) -> Tensor:
    """Every expert in expert_ids gets exactly `rows` rows (e.g. top-k == E): one bmm per projection.
    x [N, H] with N = G*rows -> [N, H]."""
    g = expert_ids.numel()
    all_experts = g == w.num_experts and expert_ids.tolist() == list(range(g))
    gate_up = w.gate_up if all_experts else w.gate_up.index_select(0, expert_ids)  # [G, 2I, H]
    down = w.down if all_experts else w.down.index_select(0, expert_ids)  # [G, H, I]
    h = torch.bmm(x.view(g, rows, -1), gate_up.transpose(1, 2))  # [G, rows, 2I]
    h = apply_activation(h, w.activation)  # [G, rows, I]
    return torch.bmm(h, down.transpose(1, 2)).reshape(x.shape)  # [N, H]
