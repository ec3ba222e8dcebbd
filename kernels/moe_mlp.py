"""The routed expert MLP with its gather and combine: tokens in, the weighted sum of their experts out.

This is the contract every expert compute runs (in process and on expert servers): rows are not
materialised by the caller; each row names the token it reads and the weight its output carries.

Shape legend:
  T  tokens handed in, H hidden
  N  rows (kept token-expert pairs), grouped by expert in the order of `expert_idx`
  G  experts that receive rows in this call, E experts held in the ExpertWeights

    out[t] = sum over rows r with token_idx[r] == t of  row_weight[r] * expert_{e(r)}(x[t])

where e(r) is the expert whose group holds row r. Accumulation is float32; tokens without a row
get zeros.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kernels.cpu.moe_mlp_cpu import compiled_variant, moe_mlp_cpu, run_compiled
from kernels.experts import ExpertWeights
from kernels.grouped import BACKENDS, grouped_expert_mlp


def moe_mlp(
    x: Tensor, token_idx: Tensor, row_weight: Tensor, expert_idx: Tensor, counts: Tensor, w: ExpertWeights,
    backend: str = "auto",
) -> Tensor:
    """x [T, H]; token_idx [N] int64 in [0, T); row_weight [N] float32; expert_idx [G] int64 indices into
    w's E; counts [G] int64 summing to N -> [T, H] in x.dtype.

    backend "cpu" (or "auto" on CPU tensors where kernels.cpu.moe_mlp_cpu.compiled_runs): the compiled
    CPU kernels, gather, both GEMMs over the weights as stored, activation and weighted combine fused.
    Otherwise the reference path: gather the rows, run `grouped_expert_mlp` with `backend`, scale each
    row by its weight in float32 and add it to its token."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "cpu":
        return moe_mlp_cpu(x, token_idx, row_weight, expert_idx, counts, w)
    if backend == "auto" and not x.is_cuda:
        variant = compiled_variant(x, counts, w, int(token_idx.shape[0]))
        if variant is not None:
            return run_compiled(x, token_idx, row_weight, expert_idx, counts, w, variant)
    rows = x.index_select(0, token_idx)  # [N, H]
    y = grouped_expert_mlp(rows, expert_idx, counts, w, "torch" if backend == "auto" and not x.is_cuda else backend)  # [N, H]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    out.index_add_(0, token_idx, y.float() * row_weight[:, None].float())
    return out.to(x.dtype)
