"""The grouped expert MLP: the one entry point that models and expert servers call.

Shape legend:
  N  rows handed to the experts (token-expert assignments), grouped by expert
  G  experts that receive rows in this call (in the order of `expert_idx`)
  E  experts held in an ExpertWeights
  H  hidden size, I  expert intermediate size
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.formats import FP8BlockExperts, MXFP4Experts, NVFP4Experts

ACTIVATIONS = ("silu", "swiglu_oai")
BACKENDS = ("auto", "torch", "triton")
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

    def to(self, device) -> "ExpertWeights":
        def move(t):
            return None if t is None else t.to(device)

        return ExpertWeights(move(self.gate_up), move(self.down), move(self.gate_up_bias), move(self.down_bias), self.activation)


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


def triton_usable(x: Tensor) -> bool:
    """Triton runs on CUDA tensors, or anywhere under TRITON_INTERPRET=1 (the CPU test mode)."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None:
        return False
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def grouped_expert_mlp(
    x: Tensor, expert_idx: Tensor, counts: Tensor, w: ExpertWeights, backend: str = "auto", *, cache=None
) -> Tensor:
    """Run each expert's MLP on its contiguous slice of rows.

    x [N, H] rows grouped by expert; expert_idx [G] int64 indices into w's E; counts [G] int64,
    sum(counts) == N (zero counts allowed). Returns [N, H] in x.dtype (unweighted expert outputs).
    Quantized weights are dequantized into x.dtype; accumulation is float32 or better.
    backend: "torch" (any device), "triton" (fused dequantize-in-the-loop kernels; CUDA, or CPU under
    TRITON_INTERPRET=1), "auto" (triton on CUDA tensors when triton is importable, else torch).
    cache: None (default: nothing kept between calls) or a caller-owned `kernels.DequantizedWeights`,
    an opt-in store of dequantized weights that the torch backend reads instead of dequantizing again
    (same outputs; memory for speed). The triton backend dequantizes inside its kernels and ignores it.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    from kernels.dequantized_cache import DequantizedWeights

    if cache is not None and not isinstance(cache, DequantizedWeights):
        raise ValueError(f"cache: expected None or a DequantizedWeights, got {type(cache).__name__}")
    if x.dim() != 2 or x.shape[1] != w.hidden_size:
        raise ValueError(f"x: expected [N, {w.hidden_size}], got shape {tuple(x.shape)}")
    if expert_idx.dim() != 1 or counts.shape != expert_idx.shape:
        raise ValueError(f"counts: expected the shape of expert_idx {tuple(expert_idx.shape)}, got {tuple(counts.shape)}")
    if backend == "auto":
        backend = "triton" if x.is_cuda and triton_usable(x) else "torch"
    if backend == "triton":
        if not triton_usable(x):
            raise ValueError("backend 'triton' needs triton and CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
        from kernels.triton.grouped_mlp import grouped_expert_mlp_triton

        return grouped_expert_mlp_triton(x, expert_idx, counts, w)
    from kernels.grouped_torch import grouped_expert_mlp_torch

    return grouped_expert_mlp_torch(x, expert_idx, counts, w, cache)
