"""A Triton kernel that writes every weight of a stored tensor through `load_weight_tile` (test aid).

Imported lazily: the Triton kernels must be defined after TRITON_INTERPRET is set.
"""
import triton
import triton.language as tl

from kernels.triton.decode import load_weight_tile


@triton.jit
def dump_kernel(out_ptr, w_ptr, s_ptr, s2_ptr, N, K, sw_e, sw_n, sw_k, ss_e, ss_r, ss_c, s2_e, seg_rows, per_seg, QBN,
                QBK: tl.constexpr, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    k0 = tl.program_id(2) * BK
    offs_k = k0 + tl.arange(0, BK)
    w = load_weight_tile(FMT, w_ptr + e * sw_e, s_ptr + e * ss_e, s2_ptr + e * s2_e, offs_n, k0, N, K,
                         sw_n, sw_k, ss_r, ss_c, seg_rows, per_seg, QBN, BK, QBK)
    w = tl.broadcast_to(w, (BN, BK))  # a dense tile; quantized tiles already are [BN, BK]
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    tl.store(out_ptr + e * N * K + offs_n[:, None] * K + offs_k[None, :], w, mask=mask)
