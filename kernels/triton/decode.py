"""Triton device helpers: decode stored codes to float32 exactly (pure bit arithmetic, so the same
code runs on GPUs and under TRITON_INTERPRET=1), and load one dequantized weight tile per format.

Shape legend: BN rows x BK columns of one weight tile; E experts; N rows; K reduction dim.
"""
from __future__ import annotations

import triton
import triton.language as tl

FMT_DENSE = 0
FMT_FP8 = 1
FMT_MXFP4 = 2
FMT_NVFP4 = 3


@triton.jit
def e4m3_to_f32(b):
    """uint8 float8_e4m3fn bytes -> float32 (NaN code not expected: loaders reject it)."""
    b = b.to(tl.int32)
    sign = (b >> 7) & 1
    ex = (b >> 3) & 15
    man = b & 7
    normal = ((ex + 120) << 23) | (man << 20)  # (1 + m/8) * 2^(ex-7) as float32 bits
    val = tl.where(ex == 0, man.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))
    return tl.where(sign == 1, -val, val)


@triton.jit
def e2m1_to_f32(code):
    """E2M1 codes (0..15, int32) -> float32: 0, .5, 1, 1.5, 2, 3, 4, 6 and negatives."""
    mag = code & 7
    ex = mag >> 1
    man = (mag & 1).to(tl.float32)
    val = tl.where(ex == 0, man * 0.5, (2.0 + man) * (1 << ex).to(tl.float32) * 0.25)
    return tl.where((code & 8) != 0, -val, val)


@triton.jit
def e8m0_to_f32(s):
    """uint8 biased exponents -> 2^(s-127) as float32 (s == 0 is the subnormal 2^-127)."""
    s = s.to(tl.int32)
    bits = tl.where(s == 0, 0x00400000, s << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def load_weight_tile(
    FMT: tl.constexpr, w_ptr, s_ptr, s2_ptr, e, offs_n, offs_k, n_lim, k_lim,
    sw_e, sw_n, sw_k, ss_e, ss_r, ss_c, s2_e, seg_rows, per_seg, QBN, QBK,
):
    """Dequantized float32 weight tile [BN, BK] of expert e (rows offs_n, columns offs_k; zero outside).

    dense  w [E, N, K]
    fp8    w [E, N, K] e4m3 bytes; s [E, NB, KB] f32, row block (n // seg_rows) * per_seg + (n % seg_rows) // QBN
    mxfp4  w [E, N, K/2] bytes (low nibble first); s [E, N, K/QBK] e8m0 bytes
    nvfp4  w [E, N, K/2] bytes; s [E, N, K/QBK] e4m3 bytes; s2 [E, S] f32 per row segment
    """
    mask = (offs_n[:, None] < n_lim) & (offs_k[None, :] < k_lim)
    e = e.to(tl.int64)
    if FMT == 0:
        ptrs = w_ptr + e * sw_e + offs_n[:, None] * sw_n + offs_k[None, :] * sw_k
        w = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    elif FMT == 1:
        b = tl.load(w_ptr + e * sw_e + offs_n[:, None] * sw_n + offs_k[None, :] * sw_k, mask=mask, other=0)
        rows = (offs_n // seg_rows) * per_seg + (offs_n % seg_rows) // QBN
        sc = tl.load(s_ptr + e * ss_e + rows[:, None] * ss_r + (offs_k // QBK)[None, :] * ss_c, mask=mask, other=0.0)
        w = e4m3_to_f32(b) * sc
    else:
        byte = tl.load(w_ptr + e * sw_e + offs_n[:, None] * sw_n + (offs_k // 2)[None, :] * sw_k, mask=mask, other=0)
        code = (byte.to(tl.int32) >> ((offs_k & 1) * 4)[None, :]) & 15
        sb = tl.load(s_ptr + e * ss_e + offs_n[:, None] * ss_r + (offs_k // QBK)[None, :] * ss_c, mask=mask, other=0)
        if FMT == 2:
            w = e2m1_to_f32(code) * e8m0_to_f32(sb)
        else:
            s2 = tl.load(s2_ptr + e * s2_e + offs_n // seg_rows, mask=offs_n < n_lim, other=0.0)
            w = e2m1_to_f32(code) * (e4m3_to_f32(sb) * s2[:, None])
    return w
