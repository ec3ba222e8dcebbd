"""One layer's experts as a process holds them (`ExpertWeights`), and what each expert computes.

Shape legend:
  N  rows handed to the experts (token-expert assignments), grouped by expert
  G  experts that receive rows in this call (in the order of `expert_idx`)
  E  experts held in an ExpertWeights
  H  hidden size, I  expert intermediate size
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.formats import FP8BlockExperts, MXFP4Experts, NVFP4Experts

ACTIVATIONS = ("silu", "swiglu_oai")
QUANTIZED_TYPES = (FP8BlockExperts, MXFP4Experts, NVFP4Experts)


def weight_format(t) -> str:
    """'fp8' | 'mxfp4' | 'nvfp4' for quantized experts, else 'dense'."""
    return t.fmt if isinstance(t, QUANTIZED_TYPES) else "dense"


@dataclass
class ExpertWeights:
    """One layer's experts as one process holds them.

    gate_up       [E, 2I, H]  rows [0, I) are the gate projection, rows [I, 2I) the up projection;
                  a dense tensor, or quantized experts (kernels.formats: FP8BlockExperts, MXFP4Experts,
                  NVFP4Experts) dequantized into the compute dtype (x.dtype) inside the grouped GEMM
    down          [E, H, I]   dense or quantized, likewise
    gate_up_bias  [E, 2I] or None (dense)
    down_bias     [E, H] or None (dense)
    activation    "silu": silu(g) * u;  "swiglu_oai" (gpt-oss): g=clamp(g,max=7), u=clamp(u,-7,7),
                  (u + 1) * g * sigmoid(1.702 g)
    """

    gate_up: Tensor | FP8BlockExperts | MXFP4Experts | NVFP4Experts
    down: Tensor | FP8BlockExperts | MXFP4Experts | NVFP4Experts
    gate_up_bias: Tensor | None = None
    down_bias: Tensor | None = None
    activation: str = "silu"
    # What the compiled CPU kernels read of these weights, built on their first call (with the
    # projections it was built from, so that replacing one rebuilds it): kernels.cpu.moe_mlp_cpu.
    # A cache, not part of the weights' value.
    kernel_view: tuple | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        for name in ("gate_up", "down"):
            t = getattr(self, name)
            if not isinstance(t, (Tensor,) + QUANTIZED_TYPES) or len(t.shape) != 3:
                raise ValueError(f"{name}: expected a [E, rows, cols] tensor or quantized experts, got {type(t).__name__}")
        e, two_i, h = self.gate_up.shape
        if two_i % 2 or tuple(self.down.shape) != (e, h, two_i // 2):
            raise ValueError(
                f"down: expected shape {(e, h, two_i // 2)} for gate_up {tuple(self.gate_up.shape)}, got {tuple(self.down.shape)}"
            )
        if self.gate_up_bias is not None and tuple(self.gate_up_bias.shape) != (e, two_i):
            raise ValueError(f"gate_up_bias: expected shape {(e, two_i)}, got {tuple(self.gate_up_bias.shape)}")
        if self.down_bias is not None and tuple(self.down_bias.shape) != (e, h):
            raise ValueError(f"down_bias: expected shape {(e, h)}, got {tuple(self.down_bias.shape)}")

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.gate_up.shape[1] // 2

    @property
    def hidden_size(self) -> int:
        return self.gate_up.shape[2]

    @property
    def fmt(self) -> str:
        """'dense' or the quantized format of gate_up ('fp8' | 'mxfp4' | 'nvfp4')."""
        return weight_format(self.gate_up)

    @property
    def nbytes(self) -> int:
        """Bytes held by the weights, scales and biases."""
        return sum(t.nbytes for t in (self.gate_up, self.down, self.gate_up_bias, self.down_bias) if t is not None)

    def select(self, experts: Tensor) -> "ExpertWeights":
        """The experts `experts` [G] (int64 indices), in that order."""
        idx = torch.as_tensor(experts, dtype=torch.long)

        def pick(t):
            if t is None:
                return None
            return t.select(idx) if isinstance(t, QUANTIZED_TYPES) else t.index_select(0, idx.to(t.device))

        return ExpertWeights(pick(self.gate_up), pick(self.down), pick(self.gate_up_bias), pick(self.down_bias), self.activation)

    @staticmethod
    def concat(parts: "list[ExpertWeights]", order: Tensor | None = None) -> "ExpertWeights":
        """The experts of `parts` one after another along E (every part in one format, with the same
        shapes per expert and the same activation); with `order` [E] (int64), expert i of the result
        is expert order[i] of that concatenation, written straight into place (one copy)."""
        if not parts or len({p.activation for p in parts}) != 1 or len({p.fmt for p in parts}) != 1:
            raise ValueError("parts: need at least one, all of one format and activation")
        total = sum(p.num_experts for p in parts)
        src = torch.arange(total) if order is None else torch.as_tensor(order, dtype=torch.long)
        if sorted(src.tolist()) != list(range(total)):
            raise ValueError(f"order must be a permutation of the {total} experts, got {src.tolist()}")
        dest = torch.empty_like(src).scatter_(0, src, torch.arange(total))  # where each concatenated expert goes
        starts = [0]
        for p in parts:
            starts.append(starts[-1] + p.num_experts)
        places = [dest[a:b] for a, b in zip(starts, starts[1:])]
        return ExpertWeights(*(_cat([getattr(p, n) for p in parts], places, n) for n in ("gate_up", "down", "gate_up_bias", "down_bias")),
                             activation=parts[0].activation)

    def to(self, device) -> "ExpertWeights":
        def move(t):
            return None if t is None else t.to(device)

        return ExpertWeights(move(self.gate_up), move(self.down), move(self.gate_up_bias), move(self.down_bias), self.activation)


def _empty_in_layout(t: Tensor, num_experts: int) -> Tensor:
    """An uninitialised tensor like `t` with `num_experts` along dim 0, its dims laid out in memory
    in `t`'s order (a view of `ConcatenatedExperts` storage stays one, so adopting it copies nothing)."""
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))  # outermost dim first
    base = t.new_empty([num_experts if d == 0 else t.shape[d] for d in order])
    return base.permute([order.index(d) for d in range(t.dim())])


def _cat(values: list, places: list[Tensor], name: str):
    """Tensors (or quantized experts, whose tensor fields all lead with E): part i's experts
    written to rows places[i] of one new tensor."""
    if all(v is None for v in values):
        return None
    if any(v is None for v in values):
        raise ValueError(f"parts: {name} is set in some parts only")
    if isinstance(values[0], Tensor):
        out = _empty_in_layout(values[0], sum(len(p) for p in places))
        for v, p in zip(values, places):
            for src, row in enumerate(p.tolist()):  # slice copies: every dtype (index_copy_ has no float8)
                out[row].copy_(v[src])
        return out
    fields = {}
    for f in dataclasses.fields(values[0]):
        vs = [getattr(v, f.name) for v in values]
        if isinstance(vs[0], Tensor) or vs[0] is None:
            fields[f.name] = _cat(vs, places, f"{name}.{f.name}")
        elif any(v != vs[0] for v in vs):
            raise ValueError(f"parts: {name}.{f.name} differs between parts ({vs})")
    return dataclasses.replace(values[0], **fields)


def dequantized(t, dtype: torch.dtype, experts: Tensor | None = None) -> Tensor:
    """Dense [E', rows, cols] in `dtype` from a dense tensor or quantized experts."""
    if isinstance(t, QUANTIZED_TYPES):
        return t.dequantize(dtype, experts)
    t = t if experts is None else t.index_select(0, experts.to(t.device))
    return t.to(dtype)


def apply_activation(gate_up: Tensor, activation: str) -> Tensor:
    """gate_up [n, 2I] -> [n, I]."""
    inter = gate_up.shape[-1] // 2
    g, u = gate_up[..., :inter], gate_up[..., inter:]
    if activation == "silu":
        return torch.nn.functional.silu(g) * u
    g = g.clamp(max=7.0)
    u = u.clamp(min=-7.0, max=7.0)
    return (u + 1.0) * g * torch.sigmoid(1.702 * g)
