"""Dense `x @ w.T` on the compiled CPU kernels: the row-streaming (and tiled) GEMV kernels the experts
run, for the attention projections, dense MLPs and the LM head at decode sizes. w is a plain float32
or bfloat16 matrix, or one held in a quantized format (kernels.formats) as a single "expert"
([1, N, K], e.g. `quantize_fp8_block(w)` of an [N, K] matrix): the kernels read its stored bytes in
place, as they read an expert's.

Shape legend: M rows of activations, K reduction dim, N output columns (rows of w).
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from kernels.cpu.build import extension
from kernels.cpu.moe_mlp_cpu import FMT_BF16, FMT_F32, projection_args
from kernels.cpu.variant import selected_variant
from kernels.experts import QUANTIZED_TYPES

DTYPES = (torch.float32, torch.bfloat16)
# Rows up to which the compiled kernels take x @ w.T, by weight dtype: float32 read 1.3-2.3x faster
# than MKL's [in, out] layout up to 16 rows with one thread; bfloat16 on bfloat16 dot products
# (AVX512-BF16, `bf16_dot`) reads a plain matrix at 0.95-1.3x oneDNN's packed layout up to 8 rows
# and at 0.8-0.95x of it at 16, and 1.15-1.5x faster than torch on the plain LM head there; without
# them bfloat16 only matches the packed layout at one row (docs/benchmarks.md). Above these (prefill)
# torch's GEMMs run.
MAX_ROWS = {torch.float32: 16, torch.bfloat16: 16}
MAX_ROWS_BF16_WIDENED = 1  # bfloat16 where the variant widens it to float32 (no bfloat16 dot products)
# Rows up to which a quantized w runs on the compiled kernels: they read its bytes once for all rows,
# where torch must first dequantize the whole matrix into a copy (a table gather per element, many
# times the cost of the matrix's own read) and only wins once that copy serves a prefill's many rows:
# on the sparse shape's attention matrices, side by side, the two crossed at several hundred rows for
# bfloat16 and later for float32; below that the kernels were faster by up to an order of magnitude.
MAX_QUANTIZED_ROWS = 256

_EMPTY = torch.empty(0)
_INTS = {torch.float32: FMT_F32, torch.bfloat16: FMT_BF16}


def linear_cpu_variant(x: Tensor, w) -> str | None:
    """The variant `layers.linear` runs x @ w.T on with `linear_cpu`, or None (then torch runs it): both
    on the CPU, x float32 or bfloat16; w of x's dtype, [N, K] plain with unit stride along K and at most
    MAX_ROWS[dtype] rows, or a one-matrix quantized w the kernels read with at most MAX_QUANTIZED_ROWS
    rows; a compiled variant selected."""
    if isinstance(w, QUANTIZED_TYPES):
        return selected_variant() if quantized_linear_args(x, w) is not None else None
    if not (x.dim() == 2 and x.dtype in DTYPES and x.device.type == "cpu" and w.device.type == "cpu"):
        return None
    if not (w.dim() == 2 and w.dtype == x.dtype and not w.is_mkldnn and w.stride(-1) == 1):
        return None
    variant = selected_variant()
    if variant is None or x.shape[0] > max_rows(x.dtype, variant):
        return None
    return variant


def max_rows(dtype: torch.dtype, variant: str) -> int:
    """The most activation rows the compiled kernels take for a plain matrix of this dtype (MAX_ROWS)."""
    if dtype == torch.bfloat16 and not bf16_dot(variant):
        return MAX_ROWS_BF16_WIDENED
    return MAX_ROWS[dtype]


@functools.cache
def bf16_dot(variant: str) -> bool:
    """Whether the variant multiplies bfloat16 activations by bfloat16 weights in bfloat16 dot products
    on this CPU (AVX512-BF16): then it reads plain bfloat16 matrices faster than torch's layouts at
    decode sizes."""
    return bool(extension().bf16_dot(variant))


def quantized_linear_args(x: Tensor, w) -> tuple | None:
    """For a one-matrix quantized w ([1, N, K]): the kernels' (ints, data, scale, scale2) view of it when
    they take x @ w.T (x float32/bfloat16 [M, K] on the CPU, M <= MAX_QUANTIZED_ROWS, a layout they
    read), else None. Built once per call and handed to `run_linear`."""
    if not (x.dim() == 2 and x.dtype in DTYPES and x.device.type == "cpu" and w.device.type == "cpu"):
        return None
    if x.shape[0] > MAX_QUANTIZED_ROWS or w.shape[0] != 1 or w.shape[2] != x.shape[1]:
        return None
    return projection_args(w)


def holds_plain(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a dense matrix of this dtype is best held plain [N, K] for `linear_cpu` rather than in a
    torch-specific layout, on the CPU where a compiled variant is selected: float32 with one torch
    thread (with more threads the oneDNN-packed layout measured as fast or faster); bfloat16 where the
    variant has bfloat16 dot products (`bf16_dot`; prefill's GEMMs on a plain matrix then run
    1.1-1.16x slower than on the packed layout at 128 rows, within 6% at 512)."""
    if device.type != "cpu":
        return False
    variant = selected_variant()
    if variant is None:
        return False
    if dtype == torch.bfloat16:
        return bf16_dot(variant)
    return dtype == torch.float32 and torch.get_num_threads() == 1


def linear_cpu(x: Tensor, w, variant: str | None = None) -> Tensor:
    """x [M, K] @ w [N, K].T -> [M, N] in x.dtype, accumulated in float32; w float32 / bfloat16 [N, K], or
    a quantized one-matrix w ([1, N, K]). variant as in `kernels.cpu.moe_mlp_cpu.moe_mlp_cpu`;
    ValueError where the compiled kernels cannot run."""
    chosen = selected_variant(variant)
    if chosen is None:
        raise ValueError("linear_cpu: no compiled CPU kernel variant is available here (or the torch path was asked for)")
    if x.dtype not in DTYPES:
        raise ValueError(f"linear_cpu: x must be float32 or bfloat16, got {x.dtype}")
    if isinstance(w, QUANTIZED_TYPES):
        if w.shape[0] != 1 or projection_args(w) is None:
            raise ValueError(f"linear_cpu: w must be one matrix ([1, N, K]) in a layout the kernels read, got {type(w).__name__} {tuple(w.shape)}")
    elif w.dtype not in DTYPES:
        raise ValueError(f"linear_cpu: w must be float32, bfloat16 or a quantized format, got {w.dtype}")
    return run_linear(x, w, chosen)


def kernel_args(w, dtype: torch.dtype, variant: str) -> tuple[tuple, int] | None:
    """A matrix as `layers.linear` holds it -> (the kernels' (ints, data, scale, scale2) view of it, the
    most activation rows of `dtype` they take it for on `variant`), or None where `linear` would not run
    it on them: w plain [N, K] of dtype on the CPU with unit stride along K (MAX_ROWS), or one quantized
    matrix [1, N, K] in a layout they read (MAX_QUANTIZED_ROWS)."""
    if isinstance(w, QUANTIZED_TYPES):
        args = projection_args(w) if w.shape[0] == 1 and w.device.type == "cpu" else None
        return (args, MAX_QUANTIZED_ROWS) if args is not None else None
    if not isinstance(w, Tensor) or w.dim() != 2 or w.dtype != dtype or dtype not in DTYPES:
        return None
    if w.device.type != "cpu" or w.is_mkldnn or w.stride(-1) != 1:
        return None
    return _plain_args(w), max_rows(dtype, variant)


def _plain_args(w: Tensor) -> tuple:
    """A plain [N, K] matrix handed over as is, its format code from the dtype."""
    return [_INTS.get(w.dtype, -1), w.shape[-1], 1, 1, 1, 1], w, _EMPTY, _EMPTY


def run_linear(x: Tensor, w, variant: str, args: tuple | None = None) -> Tensor:
    """`linear_cpu` on a variant already chosen (the extension checks shapes and dtypes); args: a
    quantized w's view from `quantized_linear_args`, when the caller has it."""
    if isinstance(w, Tensor):  # [N, K]
        args = _plain_args(w)
    elif args is None:
        args = projection_args(w)  # [1, N, K] stored bytes, scales
    out = extension().linear(x.contiguous(), *args, variant)  # [M, N] float32
    return out if x.dtype == torch.float32 else out.to(x.dtype)
