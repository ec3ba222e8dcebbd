"""The torch implementation of the grouped expert MLP (any device): the reference path, and the CPU
path where the compiled kernels (kernels.cpu) are absent or do not run a call.

Quantized weights: only the experts that receive rows are dequantized, a chunk of them at a time
(at most DEQUANT_BUDGET_BYTES of dense weights, small enough to stay in the CPU caches between the
dequantization and the matmul that reads it), one projection at a time, into the compute dtype
(x.dtype); then one grouped matmul per projection over the chunk's rows (a bmm when every expert has
the same row count, else `torch._grouped_mm` with row offsets, or a loop for other dtypes). Nothing
is kept between calls. Dense weights already in x.dtype, with experts in ascending order, are used
in place over all E (no gather, no copy).

Shape legend:
  N rows grouped by expert, G experts in the call (order of expert_idx), E experts held,
  H hidden, I intermediate.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from kernels.experts import ExpertWeights, apply_activation, dequantized

DEQUANT_BUDGET_BYTES = 4 * 2**20  # dense weights (gate_up + down) of the experts dequantized at once
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16)


def _matmul_grouped(x: Tensor, w_t: Tensor, counts: list[int]) -> Tensor:
    """x [n, K], w_t [g, K, M] (transposed weights), counts [g] summing to n -> [n, M].

    Every expert with the same row count (c > 0): one bmm; otherwise one grouped matmul with row
    offsets (float32/bfloat16 with 16-byte aligned strides), or a loop over experts otherwise."""
    if counts and counts[0] > 0 and all(c == counts[0] for c in counts):
        return torch.bmm(x.view(len(counts), counts[0], -1), w_t).reshape(x.shape[0], -1)
    if x.dtype in GROUPED_MM_DTYPES and w_t.dtype == x.dtype and _aligned16(x) and _aligned16(w_t):
        offs = torch.tensor(counts, dtype=torch.int32, device=x.device).cumsum(0, dtype=torch.int32)
        return torch._grouped_mm(x, w_t, offs=offs)
    out = x.new_empty(x.shape[0], w_t.shape[-1])
    start = 0
    for j, n in enumerate(counts):
        if n:
            out[start : start + n] = x[start : start + n] @ w_t[j]
            start += n
    return out


def _aligned16(t: Tensor) -> bool:
    """torch._grouped_mm needs 16-byte aligned data and non-unit strides (odd sizes fall back to the loop)."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s == 1 or (s * size) % 16 == 0 for s in t.stride())


def _row_bias(bias: Tensor | None, experts: Tensor, counts: list[int], dtype: torch.dtype) -> Tensor | None:
    """bias [E, M] -> [n, M]: each row's expert bias."""
    if bias is None:
        return None
    reps = torch.tensor(counts, device=bias.device)
    return bias.index_select(0, experts.to(bias.device)).to(dtype).repeat_interleave(reps, dim=0)


def _run(x: Tensor, gate_up: Callable[[], Tensor], down: Callable[[], Tensor], experts: Tensor, counts: list[int], w: ExpertWeights) -> Tensor:
    """x [n, H]; gate_up() -> [g, 2I, H]; down() -> [g, H, I] (called in turn, so that only one
    projection's dense weights are alive at a time) -> [n, H]."""
    h = _matmul_grouped(x, gate_up().transpose(1, 2), counts)  # [n, 2I]
    b = _row_bias(w.gate_up_bias, experts, counts, x.dtype)
    if b is not None:
        h = h + b
    h = apply_activation(h, w.activation)  # [n, I]
    y = _matmul_grouped(h, down().transpose(1, 2), counts)  # [n, H]
    b = _row_bias(w.down_bias, experts, counts, x.dtype)
    return y if b is None else y + b


def _in_place_dense(w: ExpertWeights, dtype: torch.dtype, expert_idx: Tensor) -> bool:
    return (
        isinstance(w.gate_up, Tensor)
        and isinstance(w.down, Tensor)
        and w.gate_up.dtype == dtype
        and w.down.dtype == dtype
        and dtype in GROUPED_MM_DTYPES
        and (expert_idx.numel() < 2 or bool((expert_idx[1:] > expert_idx[:-1]).all()))
    )


def grouped_expert_mlp_torch(x: Tensor, expert_idx: Tensor, counts: Tensor, w: ExpertWeights) -> Tensor:
    """x [N, H] grouped by expert; expert_idx [G]; counts [G] -> [N, H] in x.dtype."""
    counts_list = [int(c) for c in counts.tolist()]
    if any(c < 0 for c in counts_list) or sum(counts_list) != x.shape[0]:
        raise ValueError(f"counts: must be non-negative and sum to N={x.shape[0]}, got {counts_list}")
    experts = expert_idx.to(torch.long)
    if x.shape[0] == 0:
        return torch.empty_like(x)
    if experts.numel() and (int(experts.min()) < 0 or int(experts.max()) >= w.num_experts):
        raise ValueError(f"expert_idx: indices must lie in [0, {w.num_experts})")
    if _in_place_dense(w, x.dtype, experts):
        full = [0] * w.num_experts  # rows per held expert; experts without rows get an empty group
        for e, n in zip(experts.tolist(), counts_list):
            full[e] = n
        all_e = torch.arange(w.num_experts, device=x.device)
        return _run(x, lambda: w.gate_up, lambda: w.down, all_e, full, w)
    active = [(e, n) for e, n in zip(experts.tolist(), counts_list) if n]
    per_expert = 3 * w.intermediate_size * w.hidden_size * x.element_size()
    chunk = max(1, DEQUANT_BUDGET_BYTES // per_expert)
    out = torch.empty_like(x)
    start = 0
    for c in range(0, len(active), chunk):
        part = active[c : c + chunk]
        ids = torch.tensor([e for e, _ in part], device=x.device)
        rows = [n for _, n in part]
        n = sum(rows)

        def gate_up(ids=ids):
            return dequantized(w.gate_up, x.dtype, ids)  # [g, 2I, H]

        def down(ids=ids):
            return dequantized(w.down, x.dtype, ids)  # [g, H, I]

        out[start : start + n] = _run(x[start : start + n], gate_up, down, ids, rows, w)
        start += n
    return out
