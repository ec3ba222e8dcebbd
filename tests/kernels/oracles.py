"""Independent reference implementations (torchao, compressed-tensors) wrapped for the tests.

Each wrapper takes one 2-D weight [N, K] (K a multiple of the block; callers zero-pad edge blocks)
and returns the oracle's raw bytes/scales and dequantized values.
"""
from __future__ import annotations

import warnings

import torch


def torchao_mxfp4_floor(w: torch.Tensor):
    """-> (scales uint8 [N, K/32], packed uint8 [N, K/2], dequantized float32 [N, K])."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import MXTensor, to_mx
    w = w.float().contiguous()
    scale, data = to_mx(w, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.FLOOR)
    mx = MXTensor.to_mx(w, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.FLOOR)
    return scale.view(torch.uint8), data.view(torch.uint8), mx.dequantize(torch.float32)


def torchao_nvfp4(w: torch.Tensor):
    """-> (weight_scale e4m3 [N, K/16], packed uint8 [N, K/2], weight_scale_2 f32, dequantized [N, K])."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, nvfp4_quantize, per_tensor_amax_to_scale
    w = w.float().contiguous()
    pts = per_tensor_amax_to_scale(w.abs().max())
    scale, data = nvfp4_quantize(w, 16, pts)
    deq = NVFP4Tensor.to_nvfp4(w, per_tensor_scale=pts).dequantize(torch.float32)
    return scale, data.view(torch.uint8), pts, deq


def ct_fp8_block(w: torch.Tensor, block=(128, 128)):
    """compressed-tensors block FP8: -> (scale f32 [NB, KB], weight e4m3 [N, K], dequantized [N, K])."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=list(block), symmetric=True)
    n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n)).reshape(nb, bn, kb, bk)
    scale, zp = calculate_qparams(padded.amin(dim=(1, 3)), padded.amax(dim=(1, 3)), args)
    q = quantize(w.float(), scale, zp, args, dtype=torch.float8_e4m3fn)
    return scale, q, dequantize(q, scale, zp, args, dtype=torch.float32)


def ct_nvfp4(w: torch.Tensor):
    """compressed-tensors NVFP4: -> (weight_scale e4m3 [N, K/16], packed uint8 [N, K/2], global_scale, dequantized)."""
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp, generate_gparam

    w = w.float()
    args = QuantizationArgs(
        num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True, dynamic=False,
        scale_dtype=torch.float8_e4m3fn,
    )
    gs = generate_gparam(w.min(), w.max())
    scale, zp = compute_dynamic_scales_and_zp(w, args, module=None, global_scale=gs)
    q = quantize(w, scale, zp, args, global_scale=gs)
    deq = dequantize(q, scale.float(), zp, args, dtype=torch.float32, global_scale=gs)
    return scale.to(torch.float8_e4m3fn), pack_fp4_to_uint8(q), gs, deq
