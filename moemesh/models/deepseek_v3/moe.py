"""The MoE block of DeepSeek-V3 / Kimi-K2 / GLM-4.5: grouped sigmoid gate, routed experts through the
`ExpertCompute` seam, shared experts.

Shape legend: T tokens, H hidden, E experts, K top-k, Is shared intermediate.

Where the shared experts run: on the attention side, as a dense SwiGLU MLP next to the gate. Every
token uses them, so sending them to an expert server would ship all T tokens one more time per layer
for no saving; here they are computed *after* the routed experts have been submitted and before the
block yields, so in the mesh they overlap with the remote experts' work.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generator

import torch
from torch import Tensor

from moemesh.checkpoint import CheckpointReader
from moemesh.config import ModelConfig
from moemesh.models.deepseek_v3.config import GroupedGateConfig
from moemesh.models.deepseek_v3.grouped_topk import grouped_topk
from moemesh.models.layers import as_tensor, cat_rows, matmul_layout, silu_mlp
from moemesh.moe.dispatch import make_plan
from moemesh.moe.expert_compute import ExpertCompute, expert_output
from moemesh.contracts.knobs import LayerKnobs


@dataclass(frozen=True)
class DenseMLP:
    """gate_up [2I, H] (gate rows then up rows), down [H, I] (plain, or as `matmul_layout` holds them)."""

    gate_up: Tensor
    down: Tensor

    def __call__(self, x: Tensor) -> Tensor:
        return silu_mlp(x, self.gate_up, self.down)


def load_dense_mlp(
    reader: CheckpointReader, prefix: str, hidden: int, inter: int, dtype: torch.dtype, dense_dtype: str | None = None
) -> DenseMLP:
    """A dense (or shared-expert) MLP; with dense_dtype its matrices held in that format (`matmul_layout`)."""
    gate = reader.get(f"{prefix}.gate_proj.weight", shape=(inter, hidden), dtype=dtype)
    up = reader.get(f"{prefix}.up_proj.weight", shape=(inter, hidden), dtype=dtype)
    down = reader.get(f"{prefix}.down_proj.weight", shape=(hidden, inter), dtype=dtype)
    if dense_dtype is not None:
        return DenseMLP(matmul_layout(cat_rows([gate, up]), dense_dtype=dense_dtype), matmul_layout(down, dense_dtype=dense_dtype))
    return DenseMLP(torch.cat([gate, up]), down)


@dataclass(frozen=True)
class GateNames:
    """Where a family keeps its grouped gate on disk ({layer} is filled in); router_fp32: the router
    weight and logits are float32 (DeepSeek, as transformers keeps them), else in the compute dtype."""

    router: str = "model.layers.{layer}.mlp.gate.weight"
    correction_bias: str = "model.layers.{layer}.mlp.gate.e_score_correction_bias"
    shared_experts: str = "model.layers.{layer}.mlp.shared_experts"
    router_fp32: bool = True


@dataclass(frozen=True)
class GroupedMoE:
    """router [E, H] (float32, or the compute dtype: the gate's logits are computed in its dtype),
    correction_bias [E] float32; shared experts."""

    router: Tensor
    correction_bias: Tensor | None
    shared: DenseMLP | None


def load_grouped_moe(
    reader: CheckpointReader, layer: int, cfg: ModelConfig, gate: GroupedGateConfig, dtype: torch.dtype,
    names: GateNames = GateNames(), dense_dtype: str | None = None,
) -> GroupedMoE:
    """One MoE layer's router and shared experts (those held in dense_dtype, see `load_dense_mlp`; the
    router stays dense)."""
    e, h = cfg.num_experts, cfg.hidden_size
    bias_name = names.correction_bias.format(layer=layer)
    shared = None
    if gate.n_shared_experts:
        inter = cfg.moe_intermediate_size * gate.n_shared_experts
        shared = load_dense_mlp(reader, names.shared_experts.format(layer=layer), h, inter, dtype, dense_dtype)
    router_dtype = torch.float32 if names.router_fp32 else dtype
    return GroupedMoE(
        router=as_tensor(reader.get(names.router.format(layer=layer), shape=(e, h), dtype=router_dtype), router_dtype),
        correction_bias=reader.get(bias_name, shape=(e,), dtype=torch.float32) if reader.has(bias_name) else None,
        shared=shared,
    )


def groups_for(top_k: int, num_experts: int, gate: GroupedGateConfig) -> int:
    """Groups kept per token: the model's topk_group, widened only when a top-k knob asks for more
    experts than those groups hold (so a runtime top-k change never fails a step)."""
    per_group = num_experts // gate.n_group
    return min(gate.n_group, max(gate.topk_group, -(-top_k // per_group)))


def moe_block(
    h: Tensor, layer: int, moe: GroupedMoE, cfg: ModelConfig, gate: GroupedGateConfig, knobs: LayerKnobs, experts: ExpertCompute
) -> Generator[None, None, Tensor]:
    """h [T, H] (post-attention-normed) -> [T, H]. Yields once, while the routed experts compute."""
    top_k = knobs.top_k or cfg.top_k
    logits = (h.to(moe.router.dtype) @ moe.router.t()).float()  # [T, E]
    routing = grouped_topk(
        logits,
        top_k,
        gate.n_group,
        groups_for(top_k, cfg.num_experts, gate),
        moe.correction_bias,
        cfg.norm_topk_prob,
        gate.routed_scaling_factor,
    )  # [T, K]
    plan = make_plan(routing, cfg.num_experts, knobs.capacity_factor)
    submitted = experts.submit(layer, h, plan)
    shared = moe.shared(h) if moe.shared is not None else None  # overlaps with the routed experts
    yield
    out = expert_output(submitted)  # [T, H]
    return out if shared is None else out + shared
