"""Expert weight formats: quantize, pack, dequantize and on-disk loaders, as pure tensor functions.

Every quantized experts object has `.shape` ([E, N, K] logical), `.nbytes`, `.segments`, `.fmt`,
`.dequantize(dtype, experts=None)`, `.select(experts)` and `.to(device)`.
"""
from kernels.formats.fp8_block import (
    FP8BlockExperts, cat_fp8_block, cat_fp8_rows, fp8_block_from_checkpoint, permute_fp8_rows, quantize_fp8_block,
)
from kernels.formats.mxfp4 import MXFP4Experts, cat_mxfp4, mxfp4_from_gpt_oss, quantize_mxfp4
from kernels.formats.nvfp4 import NVFP4Experts, cat_nvfp4, nvfp4_from_modelopt, quantize_nvfp4

QuantizedExperts = FP8BlockExperts | MXFP4Experts | NVFP4Experts

__all__ = [
    "FP8BlockExperts", "MXFP4Experts", "NVFP4Experts", "QuantizedExperts",
    "quantize_fp8_block", "quantize_mxfp4", "quantize_nvfp4",
    "fp8_block_from_checkpoint", "mxfp4_from_gpt_oss", "nvfp4_from_modelopt",
    "cat_fp8_block", "cat_fp8_rows", "permute_fp8_rows", "cat_mxfp4", "cat_nvfp4",
]
