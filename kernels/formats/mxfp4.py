"""MXFP4 (OCP MX v1.0): E2M1 elements in blocks of 32 along K, one E8M0 scale 2^(byte-127) per block.

Quantize rule (FLOOR): scale exponent = floor(log2(amax(|block|))) - 2, clamped to the E8M0 range
(an all-zero block gets byte 0); elements w / 2^exp rounded half to even and saturated at +-6.
Element 2i sits in the low nibble. K not a multiple of 32 is zero-padded; `k` keeps the logical K.

The stored layout is gpt-oss's on-disk one: `*_blocks uint8 [E, N, KB, 16]`, `*_scales uint8 [E, N, KB]`.

Shape legend: E experts, N output rows, K reduction dim (logical), KB = ceil(K/32) blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.cpu import quantize_cpu
from kernels.formats.checks import (
    abs_max, check_dense_weight, check_dtype, check_finite, check_segments, expert_rows, pad_last, require_finite, row_chunks,
)
from kernels.formats.e2m1 import e2m1_pair_table, encode_packed_e2m1
from kernels.formats.lookup import byte_span, keyed_index, lookup

BLOCK = 32
E8M0_BIAS = 127
E2M1_MAX_POW2 = 2  # floor(log2(6))


@dataclass(frozen=True)
class MXFP4Experts:
    """blocks [E, N, KB, 16] uint8 (two E2M1 per byte); scales [E, N, KB] uint8 biased exponents."""

    blocks: Tensor
    scales: Tensor
    k: int
    segments: int = 1

    fmt = "mxfp4"

    def __post_init__(self) -> None:
        check_dtype(self.blocks, torch.uint8, "blocks")
        check_dtype(self.scales, torch.uint8, "scales")
        if self.blocks.dim() != 4 or self.blocks.shape[-1] != BLOCK // 2:
            raise ValueError(f"blocks: expected [E, N, KB, 16], got shape {tuple(self.blocks.shape)}")
        if tuple(self.scales.shape) != tuple(self.blocks.shape[:3]):
            raise ValueError(f"scales: expected shape {tuple(self.blocks.shape[:3])}, got {tuple(self.scales.shape)}")
        kb = self.blocks.shape[2]
        if not (isinstance(self.k, int) and (kb - 1) * BLOCK < self.k <= kb * BLOCK):
            raise ValueError(f"k: must lie in ({(kb - 1) * BLOCK}, {kb * BLOCK}] for {kb} blocks, got {self.k!r}")
        check_segments(self.blocks.shape[1], self.segments)

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype (never a compute dtype, so `w.gate_up.dtype == x.dtype` is False)."""
        return torch.uint8

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.blocks.shape[0], self.blocks.shape[1], self.k))

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes + self.scales.nbytes

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def dequantize(self, dtype: torch.dtype = torch.float32, experts: Tensor | None = None) -> Tensor:
        """-> [E', N, K] in dtype: e2m1 * 2^(scale - 127), computed in float32 or bfloat16 (exact in both:
        same exponent range; other dtypes go through float32), then cast. One gather from a table keyed
        by (scale byte, packed byte) holding both finished values of that byte."""
        blocks = expert_rows(self.blocks, experts, view=True)  # [E', N, KB, 16]
        scales = expert_rows(self.scales, experts, view=True)  # [E', N, KB]
        lo, hi = byte_span(scales)
        work = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        exps = torch.arange(lo, hi + 1, dtype=torch.int32, device=blocks.device) - E8M0_BIAS  # [R]
        mult = torch.exp2(exps.float()).to(work)[:, None, None]  # [R, 1, 1]
        table = (e2m1_pair_table(work, blocks.device).unsqueeze(0) * mult).to(dtype)  # [R, 256, 2]
        key = (scales.to(torch.int32) - lo).unsqueeze(-1)  # [E', N, KB, 1]
        vals = lookup(table, keyed_index(blocks, key))  # [E', N, KB, 16, 2]
        return vals.reshape(*blocks.shape[:2], -1)[..., : self.k]

    def select(self, experts: Tensor) -> "MXFP4Experts":
        return MXFP4Experts(expert_rows(self.blocks, experts), expert_rows(self.scales, experts), self.k, self.segments)

    def to(self, device) -> "MXFP4Experts":
        return MXFP4Experts(self.blocks.to(device), self.scales.to(device), self.k, self.segments)


def mxfp4_scale_exponent(amax: Tensor) -> Tensor:
    """amax [...] float32 >= 0 -> unbiased exponent [...] int32: floor(log2(amax)) - 2, in [-127, 127]."""
    _, e = torch.frexp(amax)  # amax = m * 2^e with m in [0.5, 1): floor(log2(amax)) = e - 1
    floor_log2 = torch.where(amax > 0, e - 1, torch.full_like(e, -E8M0_BIAS - E2M1_MAX_POW2))
    return (floor_log2 - E2M1_MAX_POW2).clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)


def exact_pow2(n: Tensor) -> Tensor:
    """n [...] int32 in [-127, 127] -> 2^n [...] float32, exactly (2^-127 as the subnormal it is)."""
    normal = (n + 127).clamp_(min=0).bitwise_left_shift_(23)
    return torch.where(n >= -126, normal, torch.full_like(normal, 0x00400000)).view(torch.float32)


def quantize_mxfp4(w: Tensor, segments: int = 1) -> MXFP4Experts:
    """w [E, N, K] or [N, K] float (finite) -> MXFP4Experts (FLOOR scales). On the CPU the compiled
    quantizer writes the same bytes in one pass per row (kernels.cpu.quantize_cpu); otherwise rows are
    quantized in cache-sized slabs: block maxima, scale exponents, elements times 2^-exponent, encoded
    and packed."""
    w = check_dense_weight(w)
    check_segments(w.shape[1], segments)
    e, n, k = w.shape
    kb = -(-k // BLOCK)
    compiled = quantize_cpu.quantize_mxfp4(w)
    if compiled is not None:
        blocks, scales, finite = compiled
        require_finite(finite)
        return MXFP4Experts(blocks.view(e, n, kb, BLOCK // 2), scales.view(e, n, kb), k, segments)
    rows = w.reshape(e * n, k)  # [R, K], a view where w is contiguous
    blocks = torch.empty(e * n, kb, BLOCK // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(e * n, kb, dtype=torch.uint8, device=w.device)
    for part in row_chunks(e * n, kb * BLOCK):
        x = pad_last(rows[part].float(), BLOCK).view(-1, kb, BLOCK)  # [r, KB, 32]
        amax = abs_max(x)  # [r, KB]
        check_finite(amax)
        exp = mxfp4_scale_exponent(amax)
        scales[part] = (exp + E8M0_BIAS).to(torch.uint8)
        blocks[part] = encode_packed_e2m1(x * exact_pow2(-exp).unsqueeze(-1))  # [r, KB, 16]
    return MXFP4Experts(blocks.view(e, n, kb, BLOCK // 2), scales.view(e, n, kb), k, segments)


def mxfp4_from_gpt_oss(blocks: Tensor, scales: Tensor, k: int | None = None, interleaved_gate_up: bool = False) -> MXFP4Experts:
    """gpt-oss on-disk tensors as stored: blocks [E, N, KB, 16] uint8, scales [E, N, KB] uint8.

    interleaved_gate_up: gpt-oss stores gate_up rows interleaved (gate rows 0, 2, 4.., up rows 1, 3, ..);
    they are reordered to gate rows then up rows (2 segments). Values are kept as stored.
    """
    check_dtype(blocks, torch.uint8, "blocks")
    check_dtype(scales, torch.uint8, "scales")
    if bool((scales == 0xFF).any()):
        raise ValueError("scales: byte 255 is the E8M0 NaN")
    if blocks.dim() != 4:
        raise ValueError(f"blocks: expected [E, N, KB, 16], got shape {tuple(blocks.shape)}")
    k = blocks.shape[2] * BLOCK if k is None else k
    if not interleaved_gate_up:
        return MXFP4Experts(blocks.contiguous(), scales.contiguous(), k, 1)
    if blocks.shape[1] % 2:
        raise ValueError(f"blocks: interleaved gate_up needs an even row count, got {blocks.shape[1]}")
    order = torch.cat([torch.arange(0, blocks.shape[1], 2), torch.arange(1, blocks.shape[1], 2)]).to(blocks.device)
    return MXFP4Experts(blocks[:, order].contiguous(), scales[:, order].contiguous(), k, 2)


def cat_mxfp4(parts: list[MXFP4Experts]) -> MXFP4Experts:
    """Stack projections along rows (gate then up)."""
    if not parts or len({p.k for p in parts}) != 1:
        raise ValueError("parts: need at least one, all with the same k")
    return MXFP4Experts(
        torch.cat([p.blocks for p in parts], dim=1), torch.cat([p.scales for p in parts], dim=1), parts[0].k,
        sum(p.segments for p in parts),
    )
