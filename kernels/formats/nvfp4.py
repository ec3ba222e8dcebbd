"""NVFP4 (ModelOpt): E2M1 elements in blocks of 16 along K, a float8_e4m3fn scale per block and a
float32 per-tensor `weight_scale_2 = amax / (6 * 448)`; W = e2m1 * (weight_scale * weight_scale_2).

Quantize rule, per tensor (one projection of one expert, i.e. one segment):
  weight_scale_2 = amax(|w|) / 2688 (1.0 for an all-zero tensor);
  weight_scale   = e4m3((amax(|block|) / 6) / weight_scale_2), 1.0 where that is 0 (ModelOpt);
  element        = e2m1(clamp(w * ((1 / weight_scale_2) / weight_scale), +-6)), half to even.
(The element arithmetic is torchao's, so bytes match it wherever the block scales agree.)
K not a multiple of 16 is zero-padded; `k` keeps the logical K.

On disk per linear: `weight uint8 [N, K/2]`, `weight_scale e4m3 [N, K/16]`, `weight_scale_2 f32 []`,
`input_scale f32 []`, with `hf_quant_config.json` {quant_algo: NVFP4, group_size: 16}.

Shape legend: E experts, N output rows, K reduction dim (logical), KP = K padded to 16, S row segments.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.cpu import quantize_cpu
from kernels.formats.checks import (
    abs_max, check_dense_weight, check_dtype, check_finite, check_segments, check_shape, expert_rows, pad_last,
    require_finite, row_chunks,
)
from kernels.formats.e2m1 import E2M1_MAX, e2m1_pair_table, encode_packed_e2m1
from kernels.formats.lookup import byte_span, keyed_index, lookup

BLOCK = 16
FP8_MAX = 448.0


@dataclass(frozen=True)
class NVFP4Experts:
    """weight [E, N, KP/2] uint8; weight_scale [E, N, KP/16] e4m3; weight_scale_2 [E, S] float32;
    input_scale [E, S] float32 or None (kept as stored; weights are dequantized, activations are not quantized)."""

    weight: Tensor
    weight_scale: Tensor
    weight_scale_2: Tensor
    k: int
    segments: int = 1
    input_scale: Tensor | None = None

    fmt = "nvfp4"

    def __post_init__(self) -> None:
        check_dtype(self.weight, torch.uint8, "weight")
        check_dtype(self.weight_scale, torch.float8_e4m3fn, "weight_scale")
        check_dtype(self.weight_scale_2, torch.float32, "weight_scale_2")
        if self.weight.dim() != 3:
            raise ValueError(f"weight: expected [E, N, KP/2], got shape {tuple(self.weight.shape)}")
        e, n, half = self.weight.shape
        if half % (BLOCK // 2):
            raise ValueError(f"weight: packed K/2 must be a multiple of 8, got {half}")
        kp = half * 2
        if not (isinstance(self.k, int) and kp - BLOCK < self.k <= kp):
            raise ValueError(f"k: must lie in ({kp - BLOCK}, {kp}], got {self.k!r}")
        check_segments(n, self.segments)
        check_shape(self.weight_scale, (e, n, kp // BLOCK), "weight_scale")
        check_shape(self.weight_scale_2, (e, self.segments), "weight_scale_2")
        if self.input_scale is not None:
            check_shape(self.input_scale, (e, self.segments), "input_scale")

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype (never a compute dtype, so `w.gate_up.dtype == x.dtype` is False)."""
        return torch.uint8

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.weight.shape[0], self.weight.shape[1], self.k))

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.weight_scale.nbytes + self.weight_scale_2.nbytes

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def row_scale_2(self, experts: Tensor | None = None) -> Tensor:
        """[E', N] float32: weight_scale_2 of each row's segment."""
        n = self.weight.shape[1]
        seg = torch.arange(n, device=self.weight.device) // (n // self.segments)
        return expert_rows(self.weight_scale_2, experts)[:, seg]

    def dequantize(self, dtype: torch.dtype = torch.float32, experts: Tensor | None = None) -> Tensor:
        """-> [E', N, K] in dtype: e2m1 * (weight_scale * weight_scale_2) in float32, then cast. One gather
        from a table keyed by (expert, segment, weight_scale byte, packed byte) holding both finished
        values of that byte."""
        packed = expert_rows(self.weight, experts, view=True)  # [E', N, KP/2]
        ws = expert_rows(self.weight_scale, experts, view=True).view(torch.uint8)  # [E', N, KB]
        s2 = expert_rows(self.weight_scale_2, experts, view=True)  # [E', S]
        e, n, _ = packed.shape
        lo, hi = byte_span(ws)
        codes = torch.arange(lo, hi + 1, dtype=torch.int32, device=packed.device).to(torch.uint8)
        scale = codes.view(torch.float8_e4m3fn).float() * s2.unsqueeze(-1)  # [E', S, R]
        pairs = e2m1_pair_table(torch.float32, packed.device)  # [256, 2]
        table = (pairs * scale[..., None, None]).to(dtype).flatten(0, 2)  # [E' * S * R, 256, 2]
        seg = torch.arange(n, device=packed.device) // (n // self.segments)  # [N]
        rows = torch.arange(e, device=packed.device)[:, None] * self.segments + seg  # [E', N]
        key = rows.to(torch.int32).unsqueeze(-1) * (hi - lo + 1) + (ws.to(torch.int32) - lo)  # [E', N, KB]
        index = keyed_index(packed.view(e, n, -1, BLOCK // 2), key.unsqueeze(-1))  # [E', N, KB, 8]
        return lookup(table, index).reshape(e, n, -1)[..., : self.k]

    def select(self, experts: Tensor) -> "NVFP4Experts":
        inp = None if self.input_scale is None else expert_rows(self.input_scale, experts)
        return NVFP4Experts(
            expert_rows(self.weight, experts), expert_rows(self.weight_scale, experts),
            expert_rows(self.weight_scale_2, experts), self.k, self.segments, inp,
        )

    def to(self, device) -> "NVFP4Experts":
        inp = None if self.input_scale is None else self.input_scale.to(device)
        return NVFP4Experts(
            self.weight.to(device), self.weight_scale.to(device), self.weight_scale_2.to(device), self.k, self.segments, inp
        )


def quantize_nvfp4(w: Tensor, segments: int = 1) -> NVFP4Experts:
    """w [E, N, K] or [N, K] float (finite) -> NVFP4Experts; each segment gets its own weight_scale_2.
    Two passes over the rows: block maxima (from which the scales follow), then the elements times
    their reciprocal scale, encoded and packed. On the CPU both passes are compiled, the block scales
    computed in the second (kernels.cpu.quantize_cpu, the same bytes); else torch over cache-sized
    slabs of rows."""
    w = check_dense_weight(w)
    seg_rows = check_segments(w.shape[1], segments)
    e, n, k = w.shape
    kb = -(-k // BLOCK)
    rows = w.reshape(e * n, k)  # [R, K], a view where w is contiguous
    chunks = row_chunks(e * n, kb * BLOCK)
    compiled = quantize_cpu.block_absmax(w, BLOCK)
    if compiled is not None:
        bmax, finite = compiled  # [R, KB]
        require_finite(finite)
    else:
        bmax = torch.empty(e * n, kb, dtype=torch.float32, device=w.device)  # [R, KB]
        for part in chunks:
            bmax[part] = abs_max(pad_last(rows[part].float(), BLOCK).view(-1, kb, BLOCK))
        check_finite(bmax)
    amax = bmax.view(e, segments, seg_rows * kb).amax(dim=-1)  # [E, S]
    scale_2 = torch.where(amax > 0, amax / (E2M1_MAX * FP8_MAX), torch.ones_like(amax))  # [E, S]
    # the block scales and elements in one compiled pass per row
    encoded = quantize_cpu.nvfp4_encode(w, segments, bmax, scale_2) if compiled is not None else None
    if encoded is not None:
        packed, scale_e4m3 = encoded
        return NVFP4Experts(packed.view(e, n, kb * BLOCK // 2), scale_e4m3.view(e, n, kb), scale_2, k, segments)
    bmax = bmax.view(e, segments, seg_rows, kb)  # [E, S, n, KB]
    scaled = ((bmax / E2M1_MAX) / scale_2[..., None, None]).clamp(max=FP8_MAX).to(torch.float8_e4m3fn).float()
    scale_e4m3 = torch.where(scaled > 0, scaled, torch.ones_like(scaled)).to(torch.float8_e4m3fn)  # [E, S, n, KB]
    reciprocal = ((1.0 / scale_2)[..., None, None] / scale_e4m3.float()).reshape(e * n, kb)  # [R, KB]
    packed = torch.empty(e * n, kb, BLOCK // 2, dtype=torch.uint8, device=w.device)  # [R, KB, 8]
    for part in chunks:
        x = pad_last(rows[part].float(), BLOCK).view(-1, kb, BLOCK)  # [r, KB, 16]
        packed[part] = encode_packed_e2m1(x * reciprocal[part].unsqueeze(-1))
    return NVFP4Experts(packed.view(e, n, kb * BLOCK // 2), scale_e4m3.view(e, n, kb), scale_2, k, segments)


def nvfp4_from_modelopt(
    weight: Tensor, weight_scale: Tensor, weight_scale_2: Tensor, input_scale: Tensor | None = None, k: int | None = None
) -> NVFP4Experts:
    """One projection of every expert as stored by ModelOpt, stacked by the caller.

    weight [E, N, K/2] uint8; weight_scale [E, N, K/16] e4m3; weight_scale_2 [E] (or [E, 1]) float32;
    input_scale [E] float32 or None. Values are kept as stored.
    """
    check_dtype(weight, torch.uint8, "weight")
    check_dtype(weight_scale, torch.float8_e4m3fn, "weight_scale")
    if weight.dim() == 2:
        weight, weight_scale = weight.unsqueeze(0), weight_scale.unsqueeze(0)
    e = weight.shape[0]
    s2 = weight_scale_2.float().reshape(e, 1)
    if not bool(torch.isfinite(s2).all()) or bool((s2 <= 0).any()):
        raise ValueError("weight_scale_2: must be finite and positive")
    if not bool(torch.isfinite(weight_scale.float()).all()):
        raise ValueError("weight_scale: contains NaN")
    inp = None if input_scale is None else input_scale.float().reshape(e, 1)
    k = weight.shape[-1] * 2 if k is None else k
    return NVFP4Experts(weight.contiguous(), weight_scale.contiguous(), s2.contiguous(), k, 1, inp)


def cat_nvfp4(parts: list[NVFP4Experts]) -> NVFP4Experts:
    """Stack projections along rows (gate then up): each keeps its weight_scale_2."""
    if not parts or len({p.k for p in parts}) != 1:
        raise ValueError("parts: need at least one, all with the same k")
    has_inp = all(p.input_scale is not None for p in parts)
    return NVFP4Experts(
        torch.cat([p.weight for p in parts], dim=1),
        torch.cat([p.weight_scale for p in parts], dim=1),
        torch.cat([p.weight_scale_2 for p in parts], dim=1),
        parts[0].k,
        sum(p.segments for p in parts),
        torch.cat([p.input_scale for p in parts], dim=1) if has_inp else None,
    )
