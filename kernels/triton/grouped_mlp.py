"""Host side of the Triton grouped expert MLP: tile schedule, format arguments, two launches.

Shape legend: N rows grouped by expert, G experts in the call, E experts held, T row tiles,
  H hidden, I intermediate.
"""
from __future__ import annotations

import torch
import triton
from torch import Tensor

from kernels.experts import ExpertWeights
from kernels.formats import FP8BlockExperts, MXFP4Experts, NVFP4Experts
from kernels.formats.mxfp4 import BLOCK as MX_BLOCK
from kernels.formats.nvfp4 import BLOCK as NV_BLOCK
from kernels.triton.decode import FMT_DENSE, FMT_FP8, FMT_MXFP4, FMT_NVFP4
from kernels.triton.gemm import ACT_SILU, ACT_SWIGLU_OAI, grouped_gemm_kernel

BM = 16  # rows per program: decode shapes put a handful of rows on each expert
# (BN, BK, num_warps): on GPUs, tiles whose sm_90 build (checked with ptxas -v, no GPU needed) spills no
# registers for every format with bfloat16 compute; float32 compute gets narrower tiles. Small tiles
# under the interpreter. BK and the scale block widths are powers of two, so a K tile covers whole
# scale blocks or lies inside one.
TILES_CUDA = (64, 64, 8)
TILES_CUDA_FLOAT32 = (32, 32, 4)
TILES_INTERPRETER = (32, 32, 4)
# Multiply-adds fused into FMAs (one rounding each, as the CPU kernels' FMAs), named at every launch
# and compile so that a change of Triton's own default (off from Triton 3.10) cannot change results.
FP_FUSION = True


def tile_schedule(expert_idx: Tensor, counts: Tensor, device) -> tuple[Tensor, Tensor, Tensor]:
    """-> (expert [T], row start [T], row end [T]) int32: each expert's rows cut into BM-row tiles."""
    experts, starts, ends = [], [], []
    start = 0
    for e, n in zip(expert_idx.tolist(), counts.tolist()):
        for r in range(start, start + n, BM):
            experts.append(e)
            starts.append(r)
            ends.append(start + n)
        start += n
    as_t = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    return as_t(experts), as_t(starts), as_t(ends)


def format_args(t, dtype: torch.dtype) -> tuple:
    """-> (FMT, w, s, s2, sw_e, sw_n, sw_k, ss_e, ss_r, ss_c, s2_e, seg_rows, per_seg, QBN, QBK)."""
    if isinstance(t, FP8BlockExperts):
        if t.block[1] & (t.block[1] - 1):
            raise ValueError(f"w: the triton backend needs a power-of-two FP8 block width, got {t.block[1]}")
        w = t.weight.view(torch.uint8)
        seg_rows = t.shape[1] // t.segments
        per_seg = t.scale.shape[1] // t.segments
        return (FMT_FP8, w, t.scale, t.scale, *w.stride(), *t.scale.stride(), 0, seg_rows, per_seg, *t.block)
    if isinstance(t, MXFP4Experts):
        w = t.blocks.flatten(-2)  # [E, N, KB*16]
        return (FMT_MXFP4, w, t.scales, t.scales, *w.stride(), *t.scales.stride(), 0, t.shape[1], 1, 1, MX_BLOCK)
    if isinstance(t, NVFP4Experts):
        s = t.weight_scale.view(torch.uint8)
        seg_rows = t.shape[1] // t.segments
        return (FMT_NVFP4, t.weight, s, t.weight_scale_2, *t.weight.stride(), *s.stride(),
                t.weight_scale_2.stride(0), seg_rows, 1, 1, NV_BLOCK)
    w = t if t.dtype == dtype else t.to(dtype)
    return (FMT_DENSE, w, w, w, *w.stride(), 0, 0, 0, 0, 1, 1, 1, 1)


def _launch(x: Tensor, out: Tensor, sched, t, bias: Tensor | None, k: int, n_out: int, gated: bool, act: int, tiles) -> None:
    fmt, w, s, s2, *ints = format_args(t, x.dtype)
    if tiles is None:
        tiles = (TILES_CUDA if x.dtype == torch.bfloat16 else TILES_CUDA_FLOAT32) if x.is_cuda else TILES_INTERPRETER
    bn, bk, warps = tiles
    b = bias.contiguous() if bias is not None else x
    grid = (sched[0].numel(), triton.cdiv(n_out, bn))
    grouped_gemm_kernel[grid](
        x, out, *sched, w, s, s2, b, k, n_out, *ints[:7], b.stride(0) if bias is not None else 0, *ints[7:10],
        QBK=ints[10], FMT=fmt, GATED=gated, ACT=act, HAS_BIAS=bias is not None,
        BF16=x.dtype == torch.bfloat16, NATIVE_BF16_DOT=x.is_cuda,
        BM=BM, BN=bn, BK=bk, num_warps=warps,
        enable_fp_fusion=FP_FUSION,
    )


def grouped_expert_mlp_triton(
    x: Tensor, expert_idx: Tensor, counts: Tensor, w: ExpertWeights, tiles: tuple[int, int, int] | None = None
) -> Tensor:
    """Same contract as kernels.grouped_expert_mlp: x [N, H] grouped by expert -> [N, H] in x.dtype.
    tiles: (BN, BK, num_warps), by default TILES_CUDA(_FLOAT32) on CUDA tensors, TILES_INTERPRETER otherwise."""
    if int(counts.sum()) != x.shape[0] or bool((counts < 0).any()):
        raise ValueError(f"counts: must be non-negative and sum to N={x.shape[0]}")
    if x.shape[0] == 0:
        return torch.empty_like(x)
    if int(expert_idx.min()) < 0 or int(expert_idx.max()) >= w.num_experts:
        raise ValueError(f"expert_idx: indices must lie in [0, {w.num_experts})")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x: the triton backend computes in float32 or bfloat16, got {x.dtype}")
    x = x.contiguous()
    sched = tile_schedule(expert_idx, counts, x.device)
    inter, hidden = w.intermediate_size, w.hidden_size
    act = ACT_SILU if w.activation == "silu" else ACT_SWIGLU_OAI
    h = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)  # [N, I]
    _launch(x, h, sched, w.gate_up, w.gate_up_bias, hidden, inter, True, act, tiles)
    out = torch.empty_like(x)  # [N, H]
    _launch(h, out, sched, w.down, w.down_bias, inter, hidden, False, act, tiles)
    return out
