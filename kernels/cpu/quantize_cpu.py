"""The weight formats' quantizers on the compiled CPU kernels (kernels/cpu/csrc/quantize_cpu.cpp): one
pass over each row writes the stored bytes, identical to the torch code of kernels/formats (which stays
the reference and runs wherever these do not).

Each function returns None where it does not run (not a CPU float32/bfloat16 tensor with unit stride
along K, no compiled kernels, or MOEMESH_CPU_KERNEL=torch), else its outputs and `finite`: False where
the weight holds inf or NaN (the caller raises its ValueError; the outputs are then meaningless).

Shape legend: E experts, N rows per expert, R = E*N rows, K row length, KB blocks per row,
S row segments, NB block rows per segment (FP8).
"""
from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor

from kernels.cpu.build import extension
from kernels.cpu.variant import selected_variant

DTYPES = (torch.float32, torch.bfloat16)


def _ext_for(w: Tensor) -> ModuleType | None:
    """The extension where it quantizes w [E, N, K] (CPU, float32/bfloat16, unit stride along K), else None."""
    if w.dtype not in DTYPES or w.device.type != "cpu" or w.dim() != 3 or w.stride(-1) != 1 or selected_variant() is None:
        return None
    return extension()


def quantize_mxfp4(w: Tensor) -> tuple[Tensor, Tensor, bool] | None:
    """w [E, N, K] -> (blocks [R, KB, 16] uint8, scales [R, KB] uint8 E8M0, finite), KB = ceil(K/32)."""
    ext = _ext_for(w)
    if ext is None:
        return None
    e, n, k = w.shape
    kb = -(-k // 32)
    blocks = torch.empty(e * n, kb, 16, dtype=torch.uint8)
    scales = torch.empty(e * n, kb, dtype=torch.uint8)
    return blocks, scales, bool(ext.quantize_mxfp4(w, blocks, scales))


def block_absmax(w: Tensor, block: int) -> tuple[Tensor, bool] | None:
    """w [E, N, K] -> (max |w| per block of `block` elements along K [R, KB] float32, finite)."""
    ext = _ext_for(w)
    if ext is None:
        return None
    e, n, k = w.shape
    out = torch.empty(e * n, -(-k // block), dtype=torch.float32)
    return out, bool(ext.block_absmax(w, block, out))


def nvfp4_encode(w: Tensor, segments: int, bmax: Tensor, scale_2: Tensor) -> tuple[Tensor, Tensor] | None:
    """w [E, N, K] (S row segments), bmax [R, KB] float32 (block_absmax(w, 16)), scale_2 [E, S] float32 ->
    (packed [R, KB, 8] uint8, weight_scale [R, KB] float8_e4m3fn): per block e4m3(min(bmax / 6 / scale_2,
    448)), 1.0 where that is 0, and the elements times (1 / scale_2) / block scale, E2M1 encoded
    (kernels.formats.e2m1.encode_e2m1) and packed, as kernels.formats.nvfp4.quantize_nvfp4 computes them."""
    ext = _ext_for(w)
    if ext is None or bmax.dtype != torch.float32 or scale_2.dtype != torch.float32:
        return None
    e, n, k = w.shape
    kb = -(-k // 16)
    packed = torch.empty(e * n, kb, 8, dtype=torch.uint8)
    scale = torch.empty(e * n, kb, dtype=torch.uint8)
    ext.nvfp4_encode(w, segments, bmax.contiguous().cpu(), scale_2.contiguous().cpu(), packed, scale)
    return packed, scale.view(torch.float8_e4m3fn)


def quantize_fp8_block(w: Tensor, block: tuple[int, int], segments: int) -> tuple[Tensor, Tensor, bool] | None:
    """w [E, N, K] (S row segments, each blocked apart) -> (weight [E, N, K] float8_e4m3fn,
    scale [E, S*NB, KB] float32 multipliers, finite), scale = amax / 448 per block (1 where all zero)."""
    ext = _ext_for(w)
    if ext is None:
        return None
    e, n, k = w.shape
    bn, bk = block
    nb, kb = -(-(n // segments) // bn), -(-k // bk)
    q = torch.empty(e, n, k, dtype=torch.uint8)
    scale = torch.empty(e, segments * nb, kb, dtype=torch.float32)
    finite = bool(ext.quantize_fp8_block(w, segments, bn, bk, q, scale))
    return q.view(torch.float8_e4m3fn), scale, finite
