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
def block_scales(row_ptrs, row_ok, k0, k_lim, ss_c, BK: tl.constexpr, QB: tl.constexpr):
    """Scales of the K tile [k0, k0+BK) for rows `row_ptrs` [BN] (pointers to each row's scales, QB
    columns per scale; rows where row_ok is False read 0). QB >= BK (QB % BK == 0): one scale per row,
    [BN, 1]; QB < BK (BK % QB == 0): [BN, BK] (each of the BK/QB scales repeated QB times)."""
    if QB >= BK:
        out = tl.load(row_ptrs + (k0 // QB) * ss_c, mask=row_ok, other=0)[:, None]
    else:
        j = k0 // QB + tl.arange(0, BK // QB)  # [BK/QB] scale columns
        s = tl.load(row_ptrs[:, None] + j[None, :] * ss_c, mask=row_ok[:, None] & (j * QB < k_lim)[None, :], other=0)
        out = tl.reshape(tl.broadcast_to(s[:, :, None], (s.shape[0], BK // QB, QB)), (s.shape[0], BK))
    return out


@triton.jit
def load_weight_tile(
    FMT: tl.constexpr, w_e, s_e, s2_e, offs_n, k0, n_lim, k_lim,
    sw_n, sw_k, ss_r, ss_c, seg_rows, per_seg, QBN,
    BK: tl.constexpr, QBK: tl.constexpr,
):
    """Dequantized float32 weight tile [BN, BK] (rows offs_n, columns k0..k0+BK; zero outside) of one
    expert, whose stored tensors start at w_e, s_e, s2_e (offsets within an expert fit in int32).

    dense  w [N, K]
    fp8    w [N, K] e4m3 bytes; s [NB, KB] f32, row block (n // seg_rows) * per_seg + (n % seg_rows) // QBN,
           QBK columns per scale
    mxfp4  w [N, K/2] bytes (low nibble first); s [N, K/QBK] e8m0 bytes (QBK = 32)
    nvfp4  w [N, K/2] bytes; s [N, K/QBK] e4m3 bytes (QBK = 16); s2 [S] f32 per row segment
    """
    row_ok = offs_n < n_lim
    if FMT == 0 or FMT == 1:
        offs_k = k0 + tl.arange(0, BK)
        mask = row_ok[:, None] & (offs_k[None, :] < k_lim)
        raw = tl.load(w_e + offs_n[:, None] * sw_n + offs_k[None, :] * sw_k, mask=mask, other=0)
        if FMT == 0:
            w = raw.to(tl.float32)
        else:
            rows = (offs_n // seg_rows) * per_seg + (offs_n % seg_rows) // QBN  # [BN] scale rows
            w = e4m3_to_f32(raw) * block_scales(s_e + rows * ss_r, row_ok, k0, k_lim, ss_c, BK, QBK)
    else:
        offs_b = k0 // 2 + tl.arange(0, BK // 2)  # [BK/2] bytes, two elements each
        mask = row_ok[:, None] & (offs_b[None, :] * 2 < k_lim)
        byte = tl.load(w_e + offs_n[:, None] * sw_n + offs_b[None, :] * sw_k, mask=mask, other=0).to(tl.int32)
        vals = tl.reshape(tl.join(e2m1_to_f32(byte & 15), e2m1_to_f32(byte >> 4)), (offs_n.shape[0], BK))
        sb = block_scales(s_e + offs_n * ss_r, row_ok, k0, k_lim, ss_c, BK, QBK)
        if FMT == 2:
            w = vals * e8m0_to_f32(sb)
        else:
            s2 = tl.load(s2_e + offs_n // seg_rows, mask=row_ok, other=0.0)
            w = vals * (e4m3_to_f32(sb) * s2[:, None])
    return w
