"""The routed expert MLP on the compiled CPU kernels: same contract as `kernels.moe_mlp`.

Weights are handed to the kernels as views of the stored tensors (no copy, no dequantization): each
projection becomes (format code, data, scale, scale2, ints) as kernels/cpu/csrc/api.h describes.

Shape legend: T tokens, H hidden, N rows grouped by expert, G experts in the call, E experts held,
I intermediate.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kernels.cpu.build import extension
from kernels.cpu.variant import selected_variant
from kernels.experts import ExpertWeights
from kernels.formats import FP8BlockExperts, MXFP4Experts, NVFP4Experts

FMT_F32, FMT_BF16, FMT_FP8, FMT_MXFP4, FMT_NVFP4 = range(5)
ACT_CODES = {"silu": 0, "swiglu_oai": 1}
CHUNK = 32  # elements the kernels decode at a time: an FP8 block width must be a multiple
COMPUTE_DTYPES = (torch.float32, torch.bfloat16)
# Above this many rows on one expert (prefill) the torch grouped path (oneDNN GEMMs on dequantized
# tiles) is at least as fast as the GEMV-shaped kernels, which are built for decode and small batches.
MAX_ROWS_PER_EXPERT = 64

_EMPTY = torch.empty(0)


def projection_args(t) -> tuple | None:
    """One projection [E, N, K] -> (ints, data, scale, scale2) for the kernels, or None where they do not
    read it (another dense dtype, a dense tensor without unit stride along K, an FP8 block width that
    is not a multiple of 32). The stored tensors are handed over as they are (the kernels read their
    bytes; no view or copy is made)."""
    if isinstance(t, FP8BlockExperts):
        bn, bk = t.block
        if bk % CHUNK:
            return None
        n = t.shape[1]
        ints = [FMT_FP8, t.shape[2], n // t.segments, t.scale.shape[1] // t.segments, bn, bk]
        return ints, t.weight, t.scale, _EMPTY
    if isinstance(t, MXFP4Experts):
        return [FMT_MXFP4, t.k, 1, 1, 1, 1], t.blocks, t.scales, _EMPTY  # blocks [E, N, KB, 16]
    if isinstance(t, NVFP4Experts):
        ints = [FMT_NVFP4, t.k, t.shape[1] // t.segments, 1, 1, 1]
        return ints, t.weight, t.weight_scale, t.weight_scale_2
    if not isinstance(t, Tensor) or t.dtype not in COMPUTE_DTYPES or t.stride(-1) != 1 or t.device.type != "cpu":
        return None
    return [FMT_F32 if t.dtype == torch.float32 else FMT_BF16, t.shape[2], 1, 1, 1, 1], t, _EMPTY, _EMPTY


def kernel_view(w: ExpertWeights) -> tuple:
    """(why the kernels cannot read w's weights or None, gate_up args, down args, gate_up bias, down
    bias), built once per ExpertWeights and kept in `w.kernel_view` with the projections it was built
    from: a decode step's call then touches none of the weights' Python objects but this tuple."""
    memo = w.kernel_view
    if memo is not None and memo[0] is w.gate_up and memo[1] is w.down and memo[2] is w.gate_up_bias and memo[3] is w.down_bias:
        return memo[4]
    reason, args = None, []
    for name in ("gate_up", "down"):
        t = getattr(w, name)
        a = projection_args(t) if t.device.type == "cpu" else None
        if reason is None and t.device.type != "cpu":
            reason = f"{name} is not on the CPU"
        elif reason is None and a is None:
            reason = f"{name}: {type(t).__name__} {getattr(t, 'dtype', '')} is not read by the kernels"
        args.append(a)
    view = (reason, args[0], args[1], _bias(w.gate_up_bias), _bias(w.down_bias))
    w.kernel_view = (w.gate_up, w.down, w.gate_up_bias, w.down_bias, view)
    return view


def unsupported(x: Tensor, w: ExpertWeights) -> str | None:
    """Why the compiled kernels cannot run this call, or None when they can."""
    if x.device.type != "cpu":
        return "x is not on the CPU"
    if x.dtype not in COMPUTE_DTYPES:
        return f"x dtype {x.dtype} (the kernels compute from float32 or bfloat16)"
    return kernel_view(w)[0]


def compiled_runs(x: Tensor, counts: Tensor, w: ExpertWeights) -> bool:
    """Whether backend "auto" runs this call on the compiled kernels: a variant is available (and not
    turned off by MOEMESH_CPU_KERNEL=torch), the kernels read x and w, and no expert gets more than
    MAX_ROWS_PER_EXPERT rows."""
    return compiled_variant(x, counts, w) is not None


def compiled_variant(x: Tensor, counts: Tensor, w: ExpertWeights, num_rows: int | None = None) -> str | None:
    """The variant backend "auto" runs this call on (see `compiled_runs`), or None for the torch path.
    num_rows: the call's N (sum of counts) when the caller knows it: at most MAX_ROWS_PER_EXPERT rows
    in all need no look at the counts (a decode step's call then reads no tensor value)."""
    if unsupported(x, w) is not None:
        return None
    chosen = selected_variant()
    if chosen is None or counts.numel() == 0 or (num_rows is not None and num_rows <= MAX_ROWS_PER_EXPERT):
        return chosen
    return chosen if int(counts.max()) <= MAX_ROWS_PER_EXPERT else None


def _bias(b: Tensor | None) -> Tensor | None:
    if b is None:
        return None
    if b.dtype not in COMPUTE_DTYPES:
        b = b.float()
    return b if b.stride(-1) == 1 else b.contiguous()


def moe_mlp_cpu(
    x: Tensor, token_idx: Tensor, row_weight: Tensor, expert_idx: Tensor, counts: Tensor, w: ExpertWeights,
    variant: str | None = None,
) -> Tensor:
    """x [T, H] float32/bfloat16; token_idx [N]; row_weight [N]; expert_idx [G]; counts [G] -> [T, H] in
    x.dtype (see kernels.moe_mlp). variant: "avx512" | "avx2" | "auto" (default: $MOEMESH_CPU_KERNEL or
    auto). Raises ValueError where the compiled kernels cannot run the call."""
    reason = unsupported(x, w)
    if reason is not None:
        raise ValueError(f"moe_mlp_cpu: {reason}")
    chosen = selected_variant(variant)
    if chosen is None:
        raise ValueError("moe_mlp_cpu: no compiled CPU kernel variant is available here (or the torch path was asked for)")
    return run_compiled(x, token_idx, row_weight, expert_idx, counts, w, chosen)


def run_compiled(
    x: Tensor, token_idx: Tensor, row_weight: Tensor, expert_idx: Tensor, counts: Tensor, w: ExpertWeights,
    variant: str,
) -> Tensor:
    """`moe_mlp_cpu` on a variant already chosen, for a call `unsupported` passed (the extension
    still checks the indices and counts)."""
    _, gu, dn, gu_bias, dn_bias = kernel_view(w)
    return extension().moe_mlp(
        _as(x, x.dtype), _as(token_idx, torch.long), _as(row_weight, torch.float32),
        _as(expert_idx, torch.long), _as(counts, torch.long),
        *gu, gu_bias, *dn, dn_bias,
        ACT_CODES[w.activation], w.intermediate_size, variant,
    )  # [T, H] in x.dtype


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t as a contiguous tensor of dtype, converted only where it is not one already."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()
