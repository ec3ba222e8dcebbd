"""One layer's experts laid side by side, for a call that routes every token to every expert held
(top-k == E, nothing dropped): the layer is then one dense SwiGLU MLP over the experts' intermediates,
with the gate weights folded in before the down projection:
    y[t] = sum_e w[t, e] * down_e(act(gate_up_e x[t]))
         = down_cat @ (w[t, :, None] * act(gate_up_cat x[t]).view(E, I)).flatten().
`LayerExperts` holds this layout next to (and over the same storage as) the per-expert one.

Shape legend: T tokens, E experts, H hidden, I intermediate.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels import ExpertWeights
from kernels.experts import apply_activation
from moemesh.models.layers import linear, packed_for_linear


@dataclass(frozen=True)
class ConcatenatedExperts:
    """gate_up [E*2I, H]: expert e's gate rows then up rows at [e*2I, (e+1)*2I) (a view of the experts'
    [E, 2I, H]); down [H, E*I]: expert e's down projection in columns [e*I, (e+1)*I)."""

    gate_up: Tensor
    down: Tensor
    num_experts: int
    activation: str

    def packed(self) -> "ConcatenatedExperts | None":
        """A copy with both matrices packed by `packed_for_linear` (bfloat16 on the CPU: a second copy
        of the weights, for a faster `mlp`); None where packing does not apply."""
        gate_up, down = packed_for_linear(self.gate_up), packed_for_linear(self.down)
        if gate_up is None or down is None:
            return None
        return ConcatenatedExperts(gate_up, down, self.num_experts, self.activation)

    @classmethod
    def adopt(cls, w: ExpertWeights) -> tuple["ConcatenatedExperts", ExpertWeights] | None:
        """For dense experts without biases: the concatenated layout, and `w` with its weights re-viewed
        from it (same values and [E, 2I, H] / [E, H, I] shapes over the concatenated storage, so no
        second copy is held). None for quantized or biased experts.
        Storage follows `matmul_layout`: float32 matrices are held [in, out] (gate_up as [H, E*2I],
        down as [E*I, H], i.e. each expert's down contiguous as [I, H]), other dtypes [out, in]."""
        if not (isinstance(w.gate_up, Tensor) and isinstance(w.down, Tensor)) or w.gate_up_bias is not None or w.down_bias is not None:
            return None
        e, h, i = w.down.shape
        if w.gate_up.dtype == torch.float32 and i % 2 == 0 and w.gate_up.device.type == "cpu":
            gate_up_t = w.gate_up.permute(2, 0, 1).reshape(h, e * 2 * i).contiguous()  # [H, E*2I]
            down_t = w.down.transpose(1, 2).contiguous()  # [E, I, H] == [E*I, H]
            cat = cls(gate_up_t.t(), down_t.view(e * i, h).t(), e, w.activation)
            gate_up = gate_up_t.view(h, e, 2 * i).permute(1, 2, 0)  # [E, 2I, H]
            down = down_t.transpose(1, 2)  # [E, H, I]
        else:
            down_cat = w.down.permute(1, 0, 2).reshape(h, e * i).contiguous()  # [H, E*I]
            gate_up = w.gate_up.contiguous()  # [E, 2I, H]
            cat = cls(gate_up.view(e * 2 * i, h), down_cat, e, w.activation)
            down = down_cat.view(h, e, i).permute(1, 0, 2)  # [E, H, I]
        return cat, ExpertWeights(gate_up, down, None, None, w.activation)

    def mlp(self, x: Tensor, weights: Tensor) -> Tensor:
        """x [T, H], weights [T, E] float32 combine weights -> [T, H] = sum_e weights[:, e] * expert_e(x),
        in x.dtype (weights applied in float32 to the intermediate activations)."""
        t, e = x.shape[0], self.num_experts
        h = linear(x, self.gate_up).view(t, e, -1)  # [T, E, 2I]
        act = apply_activation(h, self.activation)  # [T, E, I]
        act = (act * weights[:, :, None]).to(x.dtype)  # [T, E, I]
        return linear(act.view(t, -1), self.down)  # [T, H]
