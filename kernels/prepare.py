"""Turn freshly loaded expert weights into the format an engine or expert server runs.

`prepare_experts(w, fmt, compute_dtype)` is the one place `--experts-dtype` is honoured.
Quantized formats are dequantized into `compute_dtype` inside the grouped GEMM.
"""
from __future__ import annotations

import torch

from kernels.experts import ExpertWeights

EXPERT_DTYPES = ("bf16", "fp8", "mxfp4", "nvfp4")


def prepare_experts(w: ExpertWeights, fmt: str, compute_dtype: torch.dtype) -> ExpertWeights:
    """w: dense ExpertWeights as read from a checkpoint. Returns the weights in `fmt`."""
    if fmt not in EXPERT_DTYPES:
        raise ValueError(f"experts_dtype must be one of {EXPERT_DTYPES}, got {fmt!r}")
    if fmt == "bf16":
        # Round to bf16 (the storage format), compute in compute_dtype.
        def cast(t):
            return None if t is None else t.to(torch.bfloat16).to(compute_dtype)

        return ExpertWeights(cast(w.gate_up), cast(w.down), cast(w.gate_up_bias), cast(w.down_bias), w.activation)
    raise ValueError(f"experts_dtype {fmt!r} is not available in this build")
