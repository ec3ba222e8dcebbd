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
from kernels.formats import quantize_fp8_block, quantize_mxfp4, quantize_nvfp4

EXPERT_DTYPES = ("bf16", "fp8", "mxfp4", "nvfp4")
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
