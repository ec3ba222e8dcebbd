"""`RecurrentStateStore`: the engine-owned per-sequence state of a model's linear-attention layers.

Shape legend: L layers with state, S slots, C conv channels, K conv kernel, Hv value heads, Dk / Dv
key / value head dims.

One slot per running sequence (at most max_num_seqs): taken when the sequence is admitted, given back
when it finishes, is aborted or is preempted (a preempted sequence is recomputed from position 0, which
starts its state from zero). A slot's content is only read by a sequence continuing past position 0,
so slots are not cleared on reuse. The model reads and writes a step's slots through
`BatchMeta.state_slots`.
"""
from __future__ import annotations

import torch

from moemesh.engine.kv_cache import BlockAllocator
from moemesh.models.recurrent_state import LayerState, RecurrentStateSpec


class RecurrentStateStore:
    """layers: decoder layer -> LayerState (conv [S, C, K-1] in `dtype`, ssm [S, Hv, Dk, Dv] float32)."""

    def __init__(self, spec: RecurrentStateSpec, num_slots: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.slots = BlockAllocator(num_slots)
        self.layers: dict[int, LayerState] = {
            layer: LayerState(
                conv=torch.zeros(num_slots, *spec.conv_shape, dtype=dtype, device=device),
                ssm=torch.zeros(num_slots, *spec.ssm_shape, dtype=torch.float32, device=device),
            )
            for layer in spec.layers
        }

    def bytes_per_slot(self) -> int:
        return sum(s.conv[0].nbytes + s.ssm[0].nbytes for s in self.layers.values())
