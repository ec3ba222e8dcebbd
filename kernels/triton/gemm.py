"""The grouped GEMM kernel: one program per (row tile of one expert, BN output columns).

GATED (gate_up): out[r, n] = act(x[r] . Wg[e, n] + bg, x[r] . Wu[e, n] + bu) for n < I, where the
up row of n is n + I. Not gated (down): out[r, n] = x[r] . W[e, n] + b. Weights are dequantized
tile by tile inside the K loop (kernels.triton.decode), cast to the compute dtype (x's), and
multiplied with float32 accumulation. With bfloat16 compute the weights, the gate/up output and the
output are rounded to bfloat16 (ties to even) as the torch path does.

Shape legend: T row tiles, BM rows x BN columns per program, BK reduction step,
  R rows of x, K reduction dim, N_OUT output columns (I when gated, H otherwise).
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton.decode import load_weight_tile

ACT_SILU = 0
ACT_SWIGLU_OAI = 1


@triton.jit
def _activation(g, u, ACT: tl.constexpr):
    if ACT == 0:
        out = g / (1.0 + tl.exp(-g)) * u
    else:
        gc = tl.minimum(g, 7.0)
        uc = tl.minimum(tl.maximum(u, -7.0), 7.0)
        out = (uc + 1.0) * gc / (1.0 + tl.exp(-1.702 * gc))
    return out


@triton.jit
def round_to_bf16(x):
    """float32 -> float32 holding the nearest bfloat16 (ties to even), by bit arithmetic: exact on GPUs and
    in the interpreter (whose float32 -> bfloat16 cast truncates). Finite inputs."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dot(xt, w, BF16: tl.constexpr, NATIVE_BF16_DOT: tl.constexpr):
    """xt [BM, BK] float32, w [BN, BK] float32 (both bfloat16 values when BF16) -> [BM, BN] float32."""
    if BF16 and NATIVE_BF16_DOT:
        out = tl.dot(xt.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
    else:
        out = tl.dot(xt, tl.trans(w), input_precision="ieee")
    return out


@triton.jit
def grouped_gemm_kernel(
    x_ptr, out_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
    w_ptr, s_ptr, s2_ptr, b_ptr,
    K, N_OUT,
    sw_e, sw_n, sw_k, ss_e, ss_r, ss_c, s2_e, sb_e, seg_rows, per_seg, QBN,
    QBK: tl.constexpr, FMT: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BF16: tl.constexpr, NATIVE_BF16_DOT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    r0 = tl.load(tile_start_ptr + tile)
    r1 = tl.load(tile_end_ptr + tile)
    offs_m = r0 + tl.arange(0, BM)  # [BM] rows of x
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN] output columns
    row_ok = offs_m < r1
    n_rows = N_OUT * 2 if GATED else N_OUT  # weight rows held for this projection
    w_e, s_e, s2_e_ptr = w_ptr + e * sw_e, s_ptr + e * ss_e, s2_ptr + e * s2_e  # this expert's tensors
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * K  # [BM, 1]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        xt = tl.load(x_rows + offs_k[None, :], mask=row_ok[:, None] & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        wg = load_weight_tile(FMT, w_e, s_e, s2_e_ptr, offs_n, k0, N_OUT, K,
                              sw_n, sw_k, ss_r, ss_c, seg_rows, per_seg, QBN, BK, QBK)
        if BF16:
            wg = round_to_bf16(wg)
        acc += _dot(xt, wg, BF16, NATIVE_BF16_DOT)
        if GATED:
            wu = load_weight_tile(FMT, w_e, s_e, s2_e_ptr, offs_n + N_OUT, k0, n_rows, K,
                                  sw_n, sw_k, ss_r, ss_c, seg_rows, per_seg, QBN, BK, QBK)
            if BF16:
                wu = round_to_bf16(wu)
            acc_u += _dot(xt, wu, BF16, NATIVE_BF16_DOT)
    col_ok = offs_n < N_OUT
    if HAS_BIAS:
        acc += tl.load(b_ptr + e * sb_e + offs_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_u += tl.load(b_ptr + e * sb_e + N_OUT + offs_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        acc = _activation(acc, acc_u, ACT)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * N_OUT + offs_n[None, :]
    if BF16:
        acc = round_to_bf16(acc)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
