"""BlockwiseFP8 (DeepSeek-V3): float8_e4m3fn weights with one float32 multiplier per 128x128 block.

On disk per linear: `weight float8_e4m3fn [N, K]`, `weight_scale_inv float32 [ceil(N/128), ceil(K/128)]`
(a multiplier despite its name: W = weight * weight_scale_inv), partial blocks at the edges.
Quantize rule: scale = amax(|block|) / 448, weight = e4m3(clamp(w / scale, +-448)); an all-zero
block gets scale 1.0. With scale_fmt "ue8m0" the scale is rounded up to a power of two.

The experts of a layer are stacked: [E, N, K]. A fused gate|up matrix keeps the block grid of each
projection: its N rows are `segments` equal parts, each with its own ceil((N/S)/128) scale rows.

Shape legend: E experts, N output rows, K reduction dim, S row segments,
  NB scale rows (S * ceil((N/S)/BN)), KB scale columns (ceil(K/BK)), BN x BK the block.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.cpu import quantize_cpu
from kernels.formats.checks import (
    check_dense_weight, check_dtype, check_finite, check_segments, check_shape, expert_rows, require_finite, row_chunks,
)
from kernels.formats.lookup import keyed_index, lookup

FP8_MAX = 448.0
DEFAULT_BLOCK = (128, 128)
SCALE_FORMATS = (None, "ue8m0")


@dataclass(frozen=True)
class FP8BlockExperts:
    """weight [E, N, K] float8_e4m3fn; scale [E, NB, KB] float32 multiplier; block (BN, BK)."""

    weight: Tensor
    scale: Tensor
    block: tuple[int, int] = DEFAULT_BLOCK
    segments: int = 1

    def __post_init__(self) -> None:
        check_dtype(self.weight, torch.float8_e4m3fn, "weight")
        check_dtype(self.scale, torch.float32, "scale")
        if self.weight.dim() != 3:
            raise ValueError(f"weight: expected [E, N, K], got shape {tuple(self.weight.shape)}")
        e, n, k = self.weight.shape
        seg_rows = check_segments(n, self.segments)
        bn, bk = self.block
        check_shape(self.scale, (e, self.segments * math.ceil(seg_rows / bn), math.ceil(k / bk)), "scale")

    fmt = "fp8"

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype (never a compute dtype, so `w.gate_up.dtype == x.dtype` is False)."""
        return torch.float8_e4m3fn

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def row_to_scale_row(self) -> Tensor:
        """[N] int64: the scale row of each weight row."""
        n = self.weight.shape[1]
        seg_rows = n // self.segments
        per_seg = math.ceil(seg_rows / self.block[0])
        rows = torch.arange(n, device=self.weight.device)
        return (rows // seg_rows) * per_seg + (rows % seg_rows) // self.block[0]

    def dequantize(self, dtype: torch.dtype = torch.float32, experts: Tensor | None = None) -> Tensor:
        """-> [E', N, K] in dtype: weight * scale in float32, then cast. One gather from a table keyed by
        (expert, block, byte) holding the finished value (torch's e4m3 -> float32 value times the block's
        multiplier, cast to dtype)."""
        raw = expert_rows(self.weight, experts, view=True).view(torch.uint8)  # [E', N, K]
        s = expert_rows(self.scale, experts, view=True)  # [E', NB, KB]
        e, n, k = raw.shape
        nb, kb = s.shape[1:]
        bk = self.block[1]
        values = torch.arange(256, dtype=torch.int32, device=raw.device).to(torch.uint8).view(torch.float8_e4m3fn)
        table = (values.float() * s.unsqueeze(-1)).to(dtype).reshape(-1, 256, 1)  # [E' * NB * KB, 256, 1]
        rows = torch.arange(e, device=raw.device)[:, None] * nb + self.row_to_scale_row()  # [E', N]: scale row
        rows = rows.to(torch.int32) * kb
        if k % bk == 0:  # whole blocks: the key broadcasts over each block's BK bytes
            key = rows.unsqueeze(-1) + torch.arange(kb, dtype=torch.int32, device=raw.device)  # [E', N, KB]
            index = keyed_index(raw.view(e, n, kb, bk), key.unsqueeze(-1))  # [E', N, KB, BK]
        else:  # a partial edge block: one key per column
            cols = torch.arange(k, device=raw.device).to(torch.int32) // bk  # [K]
            index = keyed_index(raw, rows.unsqueeze(-1) + cols)  # [E', N, K]
        return lookup(table, index).reshape(e, n, k)

    def select(self, experts: Tensor) -> "FP8BlockExperts":
        return FP8BlockExperts(expert_rows(self.weight, experts), expert_rows(self.scale, experts), self.block, self.segments)

    def to(self, device) -> "FP8BlockExperts":
        return FP8BlockExperts(self.weight.to(device), self.scale.to(device), self.block, self.segments)


def _quantize_segment(w: Tensor, block: tuple[int, int], scale_fmt: str | None) -> tuple[Tensor, Tensor]:
    """w [E, n, K] float -> (weight [E, n, K] e4m3, scale [E, ceil(n/BN), ceil(K/BK)]), one expert and
    one slab of whole block rows at a time (no full-size float32 copy of the weight)."""
    e, n, k = w.shape
    bn, bk = block
    nb, kb = math.ceil(n / bn), math.ceil(k / bk)
    q = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(e, nb, kb, dtype=torch.float32, device=w.device)
    for i in range(e):
        for part in row_chunks(n, kb * bk, multiple=bn):
            x = w[i, part].float()  # [r, K]
            r, rb = x.shape[0], math.ceil(x.shape[0] / bn)
            blocks = torch.nn.functional.pad(x, (0, kb * bk - k, 0, rb * bn - r)).view(rb, bn, kb, bk)
            amax = blocks.abs().amax(dim=(1, 3))  # [rb, KB]
            check_finite(amax)
            s = amax / FP8_MAX
            if scale_fmt == "ue8m0":
                s = torch.exp2(torch.ceil(torch.log2(s)))
            s = torch.where(amax > 0, s, torch.ones_like(s))
            qb = (blocks / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            q[i, part] = qb.view(rb * bn, kb * bk)[:r, :k]
            scale[i, part.start // bn : part.start // bn + rb] = s
    return q, scale


def quantize_fp8_block(
    w: Tensor, block: tuple[int, int] = DEFAULT_BLOCK, segments: int = 1, scale_fmt: str | None = None
) -> FP8BlockExperts:
    """w [E, N, K] or [N, K] float (finite) -> FP8BlockExperts; each of the S row segments is blocked apart.
    On the CPU (scale_fmt None) the compiled quantizer writes the same bytes and scales
    (kernels.cpu.quantize_cpu); otherwise the torch code below, in slabs of block rows."""
    w = check_dense_weight(w)
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"block: expected two positive ints, got {block!r}")
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"scale_fmt: must be one of {SCALE_FORMATS}, got {scale_fmt!r}")
    seg_rows = check_segments(w.shape[1], segments)
    # ue8m0 rounds the scale up by torch's log2, which the compiled code does not reproduce bit for bit
    compiled = quantize_cpu.quantize_fp8_block(w, tuple(block), segments) if scale_fmt is None else None
    if compiled is not None:
        q, scale, finite = compiled
        require_finite(finite)
        return FP8BlockExperts(q, scale, tuple(block), segments)
    parts = [_quantize_segment(w[:, i * seg_rows : (i + 1) * seg_rows], tuple(block), scale_fmt) for i in range(segments)]
    return FP8BlockExperts(
        torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1), tuple(block), segments
    )


def fp8_block_from_checkpoint(weight: Tensor, weight_scale_inv: Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> FP8BlockExperts:
    """One projection of every expert as stored on disk, stacked by the caller.

    weight [E, N, K] (or [N, K]) float8_e4m3fn; weight_scale_inv [E, ceil(N/BN), ceil(K/BK)] float32
    (bf16/fp16 scales and `scale_fmt: ue8m0` scales stored as float8_e8m0fnu are widened to float32,
    exactly). Values are kept as stored.
    """
    check_dtype(weight, torch.float8_e4m3fn, "weight")
    if weight.dim() == 2:
        weight = weight.unsqueeze(0)
        weight_scale_inv = weight_scale_inv.unsqueeze(0)
    if weight_scale_inv.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu):
        raise ValueError(f"weight_scale_inv: expected a float tensor, got {weight_scale_inv.dtype}")
    scale = weight_scale_inv.float()
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise ValueError("weight_scale_inv: must be finite and non-negative")
    if not bool(torch.isfinite(weight.float()).all()):
        raise ValueError("weight: contains NaN")
    return FP8BlockExperts(weight.contiguous(), scale.contiguous(), tuple(block), 1)


def cat_fp8_block(parts: list[FP8BlockExperts]) -> FP8BlockExperts:
    """Stack projections along rows (gate then up): segments add up, each keeps its block grid."""
    if not parts:
        raise ValueError("parts: empty")
    rows = {p.weight.shape[1] // p.segments for p in parts}
    if len(rows) != 1 or len({p.block for p in parts}) != 1:
        raise ValueError("parts: every segment must have the same row count and block")
    return FP8BlockExperts(
        torch.cat([p.weight for p in parts], dim=1),
        torch.cat([p.scale for p in parts], dim=1),
        parts[0].block,
        sum(p.segments for p in parts),
    )


def permute_fp8_rows(w: FP8BlockExperts, index: Tensor) -> FP8BlockExperts:
    """Rows of one-matrix w [1, N, K] reordered (row i of the result = row index[i] of w) with every byte
    and scale kept: each row must stay within its block of rows (as a per-head permutation of the head
    dims does where a head's rows lie in one block), so the scales need no change; ValueError otherwise."""
    if w.weight.shape[0] != 1 or index.shape != (w.weight.shape[1],):
        raise ValueError(f"index: expected {w.weight.shape[1]} rows of one matrix, got {tuple(index.shape)} for {tuple(w.shape)}")
    rows = w.row_to_scale_row()
    if not bool((rows[index] == rows).all()):
        raise ValueError(
            f"index: moves rows across FP8 blocks of {w.block[0]} rows; the stored scales cannot follow (the block "
            "height must be a multiple of the permuted group)"
        )
    return FP8BlockExperts(w.weight[:, index].contiguous(), w.scale, w.block, w.segments)


def cat_fp8_rows(parts: list[FP8BlockExperts]) -> FP8BlockExperts:
    """One-matrix projections [1, N_i, K] of different row counts (q | k | v as stored) -> one [1, sum N_i, K]
    with every byte and scale value kept. The result has S equal row segments of s rows, s the largest
    divisor of every N_i that is a multiple of BN or divides BN: each segment's rows then lie in whole
    blocks of its part (s % BN == 0: its own BN-row blocks; BN % s == 0: within one block, whose scale
    row the segment gets a copy of), so the segment grid of the format holds the parts' block grids."""
    if not parts:
        raise ValueError("parts: empty")
    if any(p.weight.shape[0] != 1 or p.segments != 1 for p in parts):
        raise ValueError("parts: each must be one matrix [1, N, K] of one segment")
    if len({p.block for p in parts}) != 1 or len({p.weight.shape[2] for p in parts}) != 1:
        raise ValueError("parts: every part must have the same block and K")
    bn = parts[0].block[0]
    g = 0
    for p in parts:
        g = math.gcd(g, p.weight.shape[1])
    s = max(d for d in range(1, g + 1) if g % d == 0 and (d % bn == 0 or bn % d == 0))
    scales = []
    for p in parts:
        for o in range(0, p.weight.shape[1], s):  # segment at row o of this part
            first = o // bn
            scales.append(p.scale[:, first : first + math.ceil(s / bn)])  # [1, ceil(s/BN), KB]
    weight = torch.cat([p.weight for p in parts], dim=1)  # [1, N, K]
    return FP8BlockExperts(weight, torch.cat(scales, dim=1).contiguous(), parts[0].block, weight.shape[1] // s)
