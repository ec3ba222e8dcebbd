"""Load gpt-oss experts as stored: fused on disk, with biases, gate and up interleaved.

Shape legend: E experts (all on disk), G experts asked for, H hidden, I expert intermediate,
KB = K/32 MXFP4 blocks along the reduction dim.

On disk, per layer `model.layers.L.mlp.experts.`:
  dense  gate_up_proj [E, H, 2I] (gate = [..., ::2], up = [..., 1::2]), down_proj [E, I, H]
  MXFP4  gate_up_proj_blocks uint8 [E, 2I, KB(H), 16] + gate_up_proj_scales uint8 [E, 2I, KB(H)] (rows
         interleaved gate/up), down_proj_blocks [E, H, KB(I), 16] + down_proj_scales [E, H, KB(I)]
  both   gate_up_proj_bias [E, 2I] (interleaved), down_proj_bias [E, H]
Returned as `kernels.ExpertWeights` in the kernels' layout: gate_up [G, 2I, H] gate rows then up rows,
down [G, H, I], biases likewise, activation "swiglu_oai". MXFP4 blocks stay MXFP4 (served as stored,
only reordered into gate-then-up rows); dense weights are cast to `dtype`.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from kernels import ExpertWeights
from kernels.formats import mxfp4_from_gpt_oss
from kernels.prepare import prepare_experts
from moemesh.checkpoint import CheckpointReader
from moemesh.config import ModelConfig


def gate_then_up(t: Tensor, dim: int) -> Tensor:
    """Interleaved gate/up along `dim` (gate at even indices, up at odd) -> gate half then up half."""
    n = t.shape[dim]
    order = torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])
    return t.index_select(dim, order)


def is_mxfp4(reader: CheckpointReader, layer: int) -> bool:
    return reader.has(f"model.layers.{layer}.mlp.experts.gate_up_proj_blocks")


def load_gpt_oss_experts(
    reader: CheckpointReader,
    cfg: ModelConfig,
    layer: int,
    expert_ids: Sequence[int],
    dtype: torch.dtype,
    experts_dtype: str | None = None,
) -> ExpertWeights:
    """Experts `expert_ids` of decoder layer `layer`, in that order (same contract as
    `moemesh.moe.expert_loader.load_expert_weights`, which checks the ids and calls this for a
    gpt-oss layer)."""
    ids = [int(e) for e in expert_ids]
    e_all, h, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    sel = torch.tensor(ids, dtype=torch.long)
    p = f"model.layers.{layer}.mlp.experts"
    gate_up_bias = gate_then_up(reader.get(f"{p}.gate_up_proj_bias", shape=(e_all, 2 * inter), dtype=dtype)[sel], 1)
    down_bias = reader.get(f"{p}.down_proj_bias", shape=(e_all, h), dtype=dtype)[sel]  # [G, H]
    if is_mxfp4(reader, layer):
        kb_h, kb_i = -(-h // 32), -(-inter // 32)
        gu = mxfp4_from_gpt_oss(
            reader.get(f"{p}.gate_up_proj_blocks", shape=(e_all, 2 * inter, kb_h, 16))[sel],
            reader.get(f"{p}.gate_up_proj_scales", shape=(e_all, 2 * inter, kb_h))[sel],
            k=h,
            interleaved_gate_up=True,
        )
        down = mxfp4_from_gpt_oss(
            reader.get(f"{p}.down_proj_blocks", shape=(e_all, h, kb_i, 16))[sel],
            reader.get(f"{p}.down_proj_scales", shape=(e_all, h, kb_i))[sel],
            k=inter,
        )
        w = ExpertWeights(gu, down, gate_up_bias, down_bias, activation="swiglu_oai")
        return w if experts_dtype is None else prepare_experts(w, experts_dtype, dtype)
    fused = reader.get(f"{p}.gate_up_proj", shape=(e_all, h, 2 * inter), dtype=dtype)[sel]  # [G, H, 2I]
    gate_up = gate_then_up(fused, 2).transpose(1, 2).contiguous()  # [G, 2I, H]
    down = reader.get(f"{p}.down_proj", shape=(e_all, inter, h), dtype=dtype)[sel].transpose(1, 2).contiguous()  # [G, H, I]
    w = ExpertWeights(gate_up, down, gate_up_bias, down_bias, activation="swiglu_oai")
    if experts_dtype is not None:
        w = prepare_experts(w, experts_dtype, dtype)
    return w
