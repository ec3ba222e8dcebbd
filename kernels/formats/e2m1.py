"""FP4 E2M1 elements, shared by MXFP4 and NVFP4.

Codes 0-7 are the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign (codes 8-15 negative).
Encoding rounds half to even (on the code) and saturates at +-6; the sign bit follows the input's
sign bit, so a negative value that rounds to zero is stored as -0 (code 8), as torchao does.
Packing puts element 2i in the low nibble and element 2i+1 in the high nibble of byte i.

Shape legend: ... any leading dims, K elements along the packed (last) dim.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kernels.formats.lookup import lookup

E2M1_MAX = 6.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between consecutive magnitudes; the codes below those marked odd are odd (1, 3, 5),
# so a tie there rounds up to the even code.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_ROUNDING_UP = (0.75, 1.75, 3.5)


def encode_e2m1(x: Tensor) -> Tensor:
    """x [...] float (already divided by its scale) -> codes [...] uint8 in 0..15."""
    x = x.float()
    mag = x.abs()
    bounds = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=x.device)
    code = torch.bucketize(mag, bounds, right=False)  # number of midpoints strictly below mag
    tie_up = torch.zeros_like(mag, dtype=torch.bool)
    for t in _TIES_ROUNDING_UP:
        tie_up |= mag == t
    code = (code + tie_up.to(code.dtype)).clamp(max=7)
    sign = torch.signbit(x).to(torch.uint8) << 3
    return code.to(torch.uint8) | sign


def decode_e2m1(codes: Tensor) -> Tensor:
    """codes [...] uint8 (low 4 bits used) -> float32 values [...]."""
    lut = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), dtype=torch.float32, device=codes.device)
    return lut[(codes & 0x0F).long()]


def e2m1_pair_table(dtype: torch.dtype = torch.float32, device=None) -> Tensor:
    """[256, 2] in dtype: the two values of each byte (element 2i from the low nibble, 2i+1 from the high)."""
    single = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), dtype=dtype, device=device)
    return torch.stack([single.repeat(16), single.repeat_interleave(16)], dim=-1)  # byte = lo | hi << 4


def decode_packed_e2m1(packed: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """bytes [..., K/2] uint8 -> values [..., K] in dtype (exact for float32/bfloat16/float16).

    One gather per byte from the 256-entry pair table (both values of a byte in one machine word where
    they fit), so no separate unpack pass."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed: expected uint8, got {packed.dtype}")
    pairs = e2m1_pair_table(dtype, packed.device).unsqueeze(0)  # [1, 256, 2]
    out = lookup(pairs, packed.to(torch.int32))  # [..., K/2, 2]
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_nibbles(codes: Tensor) -> Tensor:
    """codes [..., K] uint8 (K even) -> bytes [..., K/2]; element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"codes: last dim must be even, got {codes.shape[-1]}")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] & 0x0F) | ((pairs[..., 1] & 0x0F) << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """bytes [..., K/2] uint8 -> codes [..., K] uint8."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed: expected uint8, got {packed.dtype}")
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
