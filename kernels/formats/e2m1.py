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
# Encoding works on the float32 bits of |x| (clamped to 6): from 1 up the E2M1 magnitudes are the
# floats with one mantissa bit, so rounding the float32 mantissa to its top bit (half to even, by
# adding 0x1FFFFF plus that bit's value) rounds to the nearest magnitude with ties to the even code,
# and the top 9 bits (exponent, mantissa bit) minus 252 are the code (1.0 -> 2, ..., 6.0 -> 7).
# Below 1 the magnitudes are multiples of 0.5: adding 2^22 (whose float32 ulp is 0.5) rounds half
# to even there, and the float32 bits minus those of 2^22 are the code (0, 1, 2).
_HALF_ULP = 0x1FFFFF
_CODE_OF_ONE = 252  # (bits of 1.0) >> 22 is 254, the code of 1.0 is 2
_ULP_HALF_MAGIC = 4194304.0  # 2^22
_ULP_HALF_MAGIC_BITS = 0x4A800000


def encode_e2m1(x: Tensor) -> Tensor:
    """x [...] float (already divided by its scale) -> codes [...] uint8 in 0..15, rounded half to even
    on the code, saturated at +-6; the sign bit is the input's."""
    x = x.float()
    mag = x.abs().clamp_(max=E2M1_MAX)
    bits = mag.view(torch.int32)
    normal = (bits >> 22).bitwise_and_(1).add_(bits).add_(_HALF_ULP - (_CODE_OF_ONE << 22)).bitwise_right_shift_(22)
    small = (mag + _ULP_HALF_MAGIC).view(torch.int32).sub_(_ULP_HALF_MAGIC_BITS)
    code = torch.where(mag < 1.0, small, normal)
    code.bitwise_or_((x.view(torch.int32) >> 28).bitwise_and_(8))  # bit 31 (sign) -> bit 3
    return code.to(torch.uint8)


def encode_packed_e2m1(x: Tensor) -> Tensor:
    """x [..., K] float (K even, already divided by its scales) -> bytes [..., K/2] uint8: element 2i
    in the low nibble (encoded as `encode_e2m1`), with no separate pack pass."""
    if x.shape[-1] % 2:
        raise ValueError(f"x: last dim must be even, got {x.shape[-1]}")
    lo = encode_e2m1(x[..., 0::2])
    return lo.bitwise_or_(encode_e2m1(x[..., 1::2]).bitwise_left_shift_(4))


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


def unpack_nibbles(packed: Tensor) -> Tensor:
    """bytes [..., K/2] uint8 -> codes [..., K] uint8."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed: expected uint8, got {packed.dtype}")
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
