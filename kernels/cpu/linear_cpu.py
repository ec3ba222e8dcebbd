"""Dense `x @ w.T` on the compiled CPU kernels: the row-streaming (and tiled) GEMV kernels the experts
run, for the attention projections and the LM head at decode sizes.

Shape legend: M rows of activations, K reduction dim, N output columns (rows of w).
"""
from __future__ import annotations

import torch
from torch import Tensor

from kernels.cpu.build import extension
from kernels.cpu.variant import selected_variant

DTYPES = (torch.float32, torch.bfloat16)
# Rows up to which the compiled kernels take x @ w.T, by weight dtype: float32 read 1.3-2.3x faster
# than MKL's [in, out] layout up to 16 rows with one thread; bfloat16 only matches the oneDNN-packed
# layout at one row (and beats a plain bfloat16 matrix there), and falls behind it above
# (docs/benchmarks.md). Above these (prefill) torch's GEMMs run.
MAX_ROWS = {torch.float32: 16, torch.bfloat16: 1}


def linear_cpu_variant(x: Tensor, w: Tensor) -> str | None:
    """The variant `layers.linear` runs x @ w.T on with `linear_cpu`, or None (then torch runs it): both
    on the CPU, float32 or bfloat16 of one dtype, w [N, K] plain with unit stride along K, at most
    MAX_ROWS[dtype] rows, a compiled variant selected."""
    if not (
        x.dim() == 2 and w.dim() == 2 and x.dtype in DTYPES and w.dtype == x.dtype and x.shape[0] <= MAX_ROWS[x.dtype]
        and not w.is_mkldnn and x.device.type == "cpu" and w.device.type == "cpu" and w.stride(-1) == 1
    ):
        return None
    return selected_variant()


def holds_plain(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a dense matrix of this dtype is best held plain [N, K] for `linear_cpu` rather than in a
    torch-specific layout: float32 on the CPU with one torch thread, where a compiled variant is
    selected (with more threads the oneDNN-packed layout measured as fast or faster)."""
    return dtype == torch.float32 and device.type == "cpu" and torch.get_num_threads() == 1 and selected_variant() is not None


def linear_cpu(x: Tensor, w: Tensor, variant: str | None = None) -> Tensor:
    """x [M, K] @ w [N, K].T -> [M, N] in x.dtype, accumulated in float32. variant as in
    `kernels.cpu.moe_mlp_cpu.moe_mlp_cpu`; ValueError where the compiled kernels cannot run."""
    chosen = selected_variant(variant)
    if chosen is None:
        raise ValueError("linear_cpu: no compiled CPU kernel variant is available here (or the torch path was asked for)")
    if x.dtype not in DTYPES or w.dtype not in DTYPES:
        raise ValueError(f"linear_cpu: x and w must be float32 or bfloat16, got {x.dtype} and {w.dtype}")
    return run_linear(x, w, chosen)


def run_linear(x: Tensor, w: Tensor, variant: str) -> Tensor:
    """`linear_cpu` on a variant already chosen (the extension checks shapes and dtypes)."""
    out = extension().linear(x.contiguous(), w, variant)  # [M, N] float32
    return out if x.dtype == torch.float32 else out.to(x.dtype)
