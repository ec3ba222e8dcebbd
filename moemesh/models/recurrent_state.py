"""Per-sequence recurrent state of linear-attention layers (Gated DeltaNet), as a model declares it and
sees one layer of it. The engine owns the storage (moemesh/engine/recurrent_state.py): one slot per
running sequence, taken when it is admitted and given back when it finishes, is aborted or preempted;
each step's `BatchMeta.state_slots` names every sequence's slot.

Shape legend: S slots, C conv channels, K conv kernel, Hv value heads, Dk / Dv key / value head dims.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class RecurrentStateSpec:
    """layers: the decoder layers with recurrent state; per sequence and layer a conv state
    conv_shape (C, K-1) in the compute dtype and a delta-rule state ssm_shape (Hv, Dk, Dv) in float32."""

    layers: tuple[int, ...]
    conv_shape: tuple[int, int]
    ssm_shape: tuple[int, int, int]


@dataclass(frozen=True)
class LayerState:
    """One layer's states of every slot: conv [S, C, K-1], ssm [S, Hv, Dk, Dv] float32."""

    conv: Tensor
    ssm: Tensor
