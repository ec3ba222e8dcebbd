"""Load one MoE layer's experts from a checkpoint into `kernels.ExpertWeights`.

Shape legend: E experts loaded (in the order asked for), I expert intermediate, H hidden.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kernels import ExpertWeights
from kernels.prepare import prepare_experts
from moemesh.checkpoint import CheckpointError, CheckpointReader
from moemesh.config import ModelConfig


@dataclass(frozen=True)
class ExpertLayout:
    """How one family names a layer's per-expert tensors on disk ({layer}, {expert} are filled in)."""

    prefix: str
    gate: str
    up: str
    down: str

    def names(self, layer: int, expert: int) -> tuple[str, str, str]:
        p = self.prefix.format(layer=layer, expert=expert)
        return f"{p}.{self.gate}.weight", f"{p}.{self.up}.weight", f"{p}.{self.down}.weight"


MIXTRAL_LAYOUT = ExpertLayout("model.layers.{layer}.block_sparse_moe.experts.{expert}", "w1", "w3", "w2")
QWEN_LAYOUT = ExpertLayout("model.layers.{layer}.mlp.experts.{expert}", "gate_proj", "up_proj", "down_proj")
LAYOUTS = (MIXTRAL_LAYOUT, QWEN_LAYOUT)


def find_layout(reader: CheckpointReader, layer: int, expert: int) -> ExpertLayout:
    for layout in LAYOUTS:
        if reader.has(layout.names(layer, expert)[0]):
            return layout
    tried = ", ".join(repr(l.names(layer, expert)[0]) for l in LAYOUTS)
    raise CheckpointError(f"no weights for layer {layer} expert {expert} in the checkpoint (looked for {tried})")


def load_expert_weights(
    reader: CheckpointReader,
    cfg: ModelConfig,
    layer: int,
    expert_ids: Sequence[int],
    dtype: torch.dtype,
    experts_dtype: str | None = None,
) -> ExpertWeights:
    """Experts `expert_ids` of decoder layer `layer`, stacked along E in that order.

    gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I], in `dtype`. With `experts_dtype`
    ("bf16", "fp8", ...) the result goes through `kernels.prepare.prepare_experts(w, experts_dtype, dtype)`.
    """
    ids = [int(e) for e in expert_ids]
    if not ids:
        raise ValueError("expert_ids must name at least one expert")
    for e in ids:
        if not 0 <= e < cfg.num_experts:
            raise ValueError(f"expert_ids: expert {e} is outside [0, {cfg.num_experts})")
    if not cfg.is_moe_layer(layer):
        raise ValueError(f"layer {layer} is not a MoE layer of this model")
    hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
    layout = find_layout(reader, layer, ids[0])
    gate_up = torch.empty(len(ids), 2 * inter, hidden, dtype=dtype)  # [E, 2I, H]
    down = torch.empty(len(ids), hidden, inter, dtype=dtype)  # [E, H, I]
    for i, e in enumerate(ids):
        g, u, d = layout.names(layer, e)
        gate_up[i, :inter] = reader.get(g, shape=(inter, hidden))
        gate_up[i, inter:] = reader.get(u, shape=(inter, hidden))
        down[i] = reader.get(d, shape=(hidden, inter))
    w = ExpertWeights(gate_up=gate_up, down=down)
    if experts_dtype is not None:
        w = prepare_experts(w, experts_dtype, dtype)
    return w
