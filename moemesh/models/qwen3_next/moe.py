"""The MoE block of Qwen3-Next / Qwen3.5-MoE: softmax top-k over the routed experts (through the
`ExpertCompute` seam) plus a shared expert scaled by its own sigmoid gate.

Shape legend: T tokens, H hidden, E experts, K top-k, Is shared-expert intermediate.

The shared expert runs on the attention side after the routed rows are submitted, so in the mesh it
overlaps with the remote experts (as DeepSeek's shared experts do, deepseek_v3/moe.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generator

import torch
from torch import Tensor

from moemesh.checkpoint import CheckpointReader
from moemesh.config import ModelConfig
from moemesh.models.deepseek_v3.moe import DenseMLP, load_dense_mlp
from moemesh.models.layers import linear, matmul_layout
from moemesh.moe.dispatch import make_plan
from moemesh.moe.expert_compute import ExpertCompute, expert_output
from moemesh.moe.gate import Routing, softmax_topk
from moemesh.contracts.knobs import LayerKnobs


@dataclass(frozen=True)
class SharedExpert:
    """mlp: the SwiGLU expert every token uses; gate [1, H]: its per-token sigmoid scale."""

    mlp: DenseMLP
    gate: Tensor

    def __call__(self, h: Tensor) -> Tensor:
        """h [T, H] -> sigmoid(h . gate) * mlp(h), [T, H]."""
        return torch.sigmoid(linear(h, self.gate)) * self.mlp(h)


@dataclass(frozen=True)
class SparseMoE:
    """router [E, H] (softmax gate, logits in the compute dtype); shared: None without a shared expert."""

    router: Tensor
    shared: SharedExpert | None


def load_sparse_moe(
    reader: CheckpointReader, prefix: str, cfg: ModelConfig, shared_inter: int, dtype: torch.dtype, dense_dtype: str | None = None
) -> SparseMoE:
    """prefix: the layer's `mlp` module; dense_dtype: the shared expert's matrices held in it (its gate
    and the router stay dense)."""
    h = cfg.hidden_size
    shared = None
    if shared_inter:
        mlp = load_dense_mlp(reader, f"{prefix}.shared_expert", h, shared_inter, dtype)
        gate = reader.get(f"{prefix}.shared_expert_gate.weight", shape=(1, h), dtype=dtype)
        fmt = dense_dtype
        shared = SharedExpert(DenseMLP(matmul_layout(mlp.gate_up, dense_dtype=fmt), matmul_layout(mlp.down, dense_dtype=fmt)), gate)
    return SparseMoE(reader.get(f"{prefix}.gate.weight", shape=(cfg.num_experts, h), dtype=dtype), shared)


def sparse_moe_block(
    h: Tensor, layer: int, moe: SparseMoE, cfg: ModelConfig, knobs: LayerKnobs, experts: ExpertCompute
) -> Generator[None, None, Tensor]:
    """h [T, H] (post-attention-normed) -> [T, H]. Yields once, while the routed experts compute."""
    routing = softmax_topk(linear(h, moe.router), knobs.top_k or cfg.top_k, cfg.norm_topk_prob)  # [T, K]
    # transformers hands the experts these weights in the compute dtype
    routing = Routing(routing.expert_ids, routing.weights.to(h.dtype).float())
    plan = make_plan(routing, cfg.num_experts, knobs.capacity_factor)
    submitted = experts.submit(layer, h, plan)
    shared = moe.shared(h) if moe.shared is not None else None  # overlaps with the routed experts
    yield
    out = expert_output(submitted)  # [T, H]
    return out if shared is None else out + shared
