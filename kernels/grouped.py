"""The grouped expert MLP (unweighted per-row outputs): pick the implementation for a call.

Shape legend:
  N  rows handed to the experts (token-expert assignments), grouped by expert
  G  experts that receive rows in this call (in the order of `expert_idx`)
  H  hidden size
"""
from __future__ import annotations

import importlib.util
import os

import torch
from torch import Tensor

from kernels.cpu.moe_mlp_cpu import compiled_runs, moe_mlp_cpu
from kernels.experts import ExpertWeights
from kernels.grouped_torch import grouped_expert_mlp_torch

BACKENDS = ("auto", "torch", "triton", "cpu")


def triton_usable(x: Tensor) -> bool:
    """Triton runs on CUDA tensors, or anywhere under TRITON_INTERPRET=1 (the CPU test mode)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def grouped_expert_mlp(x: Tensor, expert_idx: Tensor, counts: Tensor, w: ExpertWeights, backend: str = "auto") -> Tensor:
    """Run each expert's MLP on its contiguous slice of rows.

    x [N, H] rows grouped by expert; expert_idx [G] int64 indices into w's E; counts [G] int64,
    sum(counts) == N (zero counts allowed). Returns [N, H] in x.dtype (unweighted expert outputs).
    Quantized weights are dequantized into x.dtype (torch) or read packed (cpu, triton); accumulation
    is float32 or better.
    backend: "torch" (any device: dequantize, then grouped matmuls), "cpu" (the compiled CPU kernels,
    kernels.cpu), "triton" (fused dequantize-in-the-loop kernels; CUDA, or CPU under
    TRITON_INTERPRET=1), "auto" (triton on CUDA tensors when triton is importable; on the CPU the
    compiled kernels where they run the call, see kernels.cpu.moe_mlp_cpu.compiled_runs; else torch).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if x.dim() != 2 or x.shape[1] != w.hidden_size:
        raise ValueError(f"x: expected [N, {w.hidden_size}], got shape {tuple(x.shape)}")
    if expert_idx.dim() != 1 or counts.shape != expert_idx.shape:
        raise ValueError(f"counts: expected the shape of expert_idx {tuple(expert_idx.shape)}, got {tuple(counts.shape)}")
    if backend == "auto":
        if x.is_cuda:
            backend = "triton" if triton_usable(x) else "torch"
        else:
            backend = "cpu" if compiled_runs(x, counts, w) else "torch"
    if backend == "cpu":
        rows = torch.arange(x.shape[0], device=x.device)  # each row is its own token, with weight 1
        return moe_mlp_cpu(x, rows, torch.ones(x.shape[0]), expert_idx, counts, w)
    if backend == "triton":
        if not triton_usable(x):
            raise ValueError("backend 'triton' needs triton and CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
        from kernels.triton.grouped_mlp import grouped_expert_mlp_triton

        return grouped_expert_mlp_triton(x, expert_idx, counts, w)
    return grouped_expert_mlp_torch(x, expert_idx, counts, w)
