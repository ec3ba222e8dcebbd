"""Turn freshly loaded expert weights into the format an engine or expert server runs.

`prepare_experts(w, fmt, compute_dtype)` is the one place `--experts-dtype` is honoured:
  bf16   weights rounded to bfloat16 and held in compute_dtype
  fp8    BlockwiseFP8, 128x128 blocks, gate and up blocked as separate projections
  mxfp4  MXFP4 (FLOOR scales, blocks of 32 along H / I)
  nvfp4  NVFP4 (ModelOpt), gate and up each with their own weight_scale_2
Quantization follows DESIGN.md section 4 (see kernels/formats). Weights that are already quantized
(a checkpoint stored in one of the formats) are served as stored: nothing is re-quantized.
Quantized formats are dequantized into the compute dtype (x.dtype) inside the grouped GEMM.
Biases stay dense, in compute_dtype.
"""
from __future__ import annotations

import torch

from kernels.experts import QUANTIZED_TYPES, ExpertWeights
from kernels.formats import FP8BlockExperts, quantize_fp8_block, quantize_mxfp4, quantize_nvfp4

EXPERT_DTYPES = ("bf16", "fp8", "mxfp4", "nvfp4")
# Formats a dense linear's weight (attention projections, dense MLP, shared experts, LM head) may be
# held in (`EngineConfig.dense_dtype`): fp8 = BlockwiseFP8 with 128x128 blocks.
DENSE_DTYPES = ("fp8",)
_QUANTIZERS = {"fp8": quantize_fp8_block, "mxfp4": quantize_mxfp4, "nvfp4": quantize_nvfp4}


def prepare_experts(w: ExpertWeights, fmt: str, compute_dtype: torch.dtype) -> ExpertWeights:
    """w: ExpertWeights as read from a checkpoint (dense, or already quantized). Returns the weights in `fmt`."""
    if fmt not in EXPERT_DTYPES:
        raise ValueError(f"experts_dtype must be one of {EXPERT_DTYPES}, got {fmt!r}")

    def cast(t):
        return None if t is None else t.to(compute_dtype)

    def bf16(t):
        return None if t is None else t.to(torch.bfloat16).to(compute_dtype)

    if isinstance(w.gate_up, QUANTIZED_TYPES) or isinstance(w.down, QUANTIZED_TYPES):
        return ExpertWeights(w.gate_up, w.down, cast(w.gate_up_bias), cast(w.down_bias), w.activation)
    if fmt == "bf16":
        return ExpertWeights(bf16(w.gate_up), bf16(w.down), bf16(w.gate_up_bias), bf16(w.down_bias), w.activation)
    quantize = _QUANTIZERS[fmt]
    return ExpertWeights(
        quantize(w.gate_up, segments=2), quantize(w.down), cast(w.gate_up_bias), cast(w.down_bias), w.activation
    )


def check_dense_dtype(fmt: str | None) -> None:
    """ValueError naming `dense_dtype` unless fmt is None (as stored / the compute dtype) or in DENSE_DTYPES."""
    if fmt is not None and fmt not in DENSE_DTYPES:
        raise ValueError(f"dense_dtype must be one of {DENSE_DTYPES} (or unset), got {fmt!r}")


def prepare_dense(w, fmt: str):
    """One dense linear's weight w [N, K] (float, as read) -> held in `fmt` as one matrix ([1, N, K]):
    "fp8" quantizes it to BlockwiseFP8 128x128 (`quantize_fp8_block`). A weight already held in that
    format (read from a BlockwiseFP8 checkpoint) is kept as stored: nothing is re-quantized."""
    check_dense_dtype(fmt)
    if fmt is None:
        raise ValueError("dense_dtype: a format is needed here, got None")
    if isinstance(w, FP8BlockExperts):
        if w.shape[0] != 1:
            raise ValueError(f"dense_dtype fp8: expected one matrix [1, N, K], got {tuple(w.shape)}")
        return w
    if isinstance(w, QUANTIZED_TYPES):
        raise ValueError(f"dense_dtype {fmt!r}: a weight stored as {w.fmt} is not converted to it")
    if w.dim() != 2:
        raise ValueError(f"dense_dtype {fmt!r}: expected a [N, K] weight, got shape {tuple(w.shape)}")
    return quantize_fp8_block(w)
