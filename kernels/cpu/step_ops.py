"""The decode step's small operations on the compiled CPU kernels (kernels/cpu/csrc/step_ops.cpp):
RMSNorm (after the residual add), the per-head q/k RMSNorm with rope, decode attention over the paged
KV cache, the softmax top-k routing plan.

Each is one compiled call where the torch code it replaces dispatches several ops; the numbers agree
with that code to float rounding (same rounding points, float32 sums in another order). Each returns
None where it does not run (not on the CPU, another dtype, a layout it does not read, no compiled
kernels, or MOEMESH_CPU_KERNEL=torch): the caller then runs its torch code.

Shape legend: T tokens, R rows per token (heads), D row length, E experts, N = T*K routed rows,
G experts that receive rows.
"""
from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor

from kernels.cpu.build import extension
from kernels.cpu.variant import selected_variant

DTYPES = (torch.float32, torch.bfloat16)


def _ext_for(x: Tensor) -> ModuleType | None:
    """The extension where it runs ops on x (a CPU float32/bfloat16 tensor, a variant selected), else None."""
    if x.dtype not in DTYPES or x.device.type != "cpu" or selected_variant() is None:
        return None
    return extension()


def _reads_rows(x: Tensor, weight: Tensor) -> bool:
    """x [D], [T, D] or [T, R, D] with unit stride along D; weight [D] (or [R, D] for 2+ dims) of x's dtype, contiguous."""
    d = x.shape[-1]
    if not 1 <= x.dim() <= 3 or x.stride(-1) != 1 or weight.dtype != x.dtype or not weight.is_contiguous():
        return False
    return tuple(weight.shape) == (d,) or (x.dim() >= 2 and tuple(weight.shape) == (x.shape[-2], d))


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor | None:
    """x [..., D] -> [..., D] contiguous, x.dtype: round(round(x * rsqrt(mean(x^2) + eps)) * weight)
    (moemesh.models.layers.rms_norm); weight [D] or [R, D] for x [T, R, D]. None where it does not run."""
    ext = _ext_for(x)
    if ext is None or not _reads_rows(x, weight):
        return None
    return ext.rms_norm(x, weight, eps)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor] | None:
    """x, residual [T, D] -> (x + residual, rms_norm(x + residual, weight)), both [T, D] in x.dtype.
    None where it does not run."""
    ext = _ext_for(x)
    if (
        ext is None or x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype
        or residual.device != x.device or residual.stride(-1) != 1 or not _reads_rows(x, weight)
        or weight.dim() != 1
    ):
        return None
    return ext.add_rms_norm(x, residual, weight, eps)


def qk_norm_rope(heads: Tensor, weight: Tensor, eps: float, cos: Tensor, sin_signed: Tensor) -> Tensor | None:
    """heads [T, R, D] -> [T, R, D] contiguous: rms_norm with weight [R, D], then
    moemesh.models.layers.apply_rope_signed with cos / sin_signed [T, 1, D] (heads' dtype).
    None where it does not run."""
    ext = _ext_for(heads)
    if (
        ext is None or heads.dim() != 3 or heads.shape[-1] % 2 or not _reads_rows(heads, weight)
        or cos.dtype != heads.dtype or sin_signed.dtype != heads.dtype
        or cos.stride(-1) != 1 or sin_signed.stride(-1) != 1
    ):
        return None
    return ext.qk_norm_rope(heads, weight, cos, sin_signed, eps)


def decode_attention(
    q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, tables: Tensor, mask: Tensor,
) -> Tensor | None:
    """One query token per sequence: q [B, NH, D], k / v [B, KVH, D] (unit stride along D) -> [B, NH, D]
    contiguous; writes k / v into k_cache / v_cache [blocks, BS, KVH, D] at slots [B] first, then
    attends over each sequence's blocks tables [B, NB] where mask [B, NB*BS] is true (scale D^-0.5),
    as moemesh.models.attention.paged_attention's decode rows (SDPA) compute it, on the selected
    variant's inner loops (the plain C++ ones for a head dim they do not take). None where it does
    not run."""
    ext = _ext_for(q)
    if (
        ext is None or k.dtype != q.dtype or v.dtype != q.dtype or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype
        or not k_cache.is_contiguous() or not v_cache.is_contiguous() or q.stride(-1) != 1 or k.stride(-1) != 1
        or v.stride(-1) != 1 or k_cache.device.type != "cpu" or v_cache.device.type != "cpu"
    ):
        return None
    return ext.decode_attention(q, k, v, k_cache, v_cache, slots, tables, mask, selected_variant())


def route_topk(router_logits: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """router_logits [T, E] -> token_idx [N] int64, weights [N] float32, expert_ids [G] int64,
    counts [G] int64: moemesh.moe.dispatch.make_plan's dropless plan of moemesh.moe.gate.softmax_topk.
    None where it does not run."""
    ext = _ext_for(router_logits)
    if ext is None or router_logits.dim() != 2:
        return None
    return ext.route_topk(router_logits, top_k, normalize)
