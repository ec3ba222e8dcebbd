"""`RecurrentStateStore`: the engine-owned per-sequence state of a model's linear-attention layers.

Shape legend: L layers with state, S slots, C conv channels, K conv kernel, Hv value heads, Dk / Dv
key / value head dims.

One slot per running sequence (max_num_seqs slots, so every admitted sequence finds one): the
scheduler takes it when it admits the sequence and gives it back when the sequence finishes, is
aborted or is preempted (a preempted sequence is recomputed from position 0, which starts its state
from zero). A slot's content is only read by a sequence continuing past position 0 (a decode, or a
prompt chunk after earlier chunks), so slots are not cleared on reuse. The model reads and writes a
step's slots through `BatchMeta.state_slots`.
"""
from __future__ import annotations

import torch

from moemesh.engine.block_pool import BlockPool
from moemesh.models.recurrent_state import LayerState, RecurrentStateSpec


class RecurrentStateStore:
    """layers: decoder layer -> LayerState (conv [S, C, K-1] in `dtype`, ssm [S, Hv, Dk, Dv] float32);
    slots: the free list of slot ids (a `BlockPool` without caching)."""

    def __init__(self, spec: RecurrentStateSpec, num_slots: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.slots = BlockPool(num_slots, caching=False)
        self.layers: dict[int, LayerState] = {
            layer: LayerState(
                conv=torch.zeros(num_slots, *spec.conv_shape, dtype=dtype, device=device),
                ssm=torch.zeros(num_slots, *spec.ssm_shape, dtype=torch.float32, device=device),
            )
            for layer in spec.layers
        }

