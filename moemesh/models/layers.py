"""Small tensor functions shared by the decoders: RMSNorm, rotary embeddings, the dense SiLU MLP.

Shape legend: T tokens, H hidden, D head dim, NH heads, I intermediate, P positions.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.cpu import step_ops
from kernels.cpu.linear_cpu import holds_plain, linear_cpu_variant, quantized_linear_args, run_linear
from kernels.cpu.variant import selected_variant
from kernels.experts import QUANTIZED_TYPES
from kernels.formats import FP8BlockExperts, cat_fp8_rows
from kernels.hugepages import huge_page_copy
from kernels.prepare import prepare_dense


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., D] -> [..., D]; normalizes in float32, scales in x.dtype (as transformers does).
    weight [D], or any shape broadcasting against x (e.g. [heads, D] for per-head norms).
    One compiled call on the CPU where `kernels.cpu.step_ops` runs it (same rounding points)."""
    out = step_ops.rms_norm(x, weight, eps)
    if out is not None:
        return out
    if x.dtype == torch.float32 and weight.dim() == 1:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # F.rms_norm without a weight rounds the normalized value to x.dtype, as transformers does
    return F.rms_norm(x, (x.shape[-1],), None, eps) * weight


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x, residual [T, H] -> (x + residual, rms_norm(x + residual)) [T, H] each: the residual stream's
    add and the next norm, in one compiled call on the CPU where `kernels.cpu.step_ops` runs it."""
    both = step_ops.add_rms_norm(x, residual, weight, eps)
    if both is not None:
        return both
    x = x + residual
    return x, rms_norm(x, weight, eps)


def norm_rope(heads: Tensor, weight: Tensor | None, eps: float, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """heads [T, NH, D] -> [T, NH, D]: the per-head RMSNorm (weight [NH, D] or [D]; None: no norm),
    then `apply_rope_signed`; one compiled call on the CPU where `kernels.cpu.step_ops` runs it."""
    out = step_ops.qk_norm_rope(heads, weight, eps, cos, sin_signed)
    if out is not None:
        return out
    if weight is not None:
        heads = rms_norm(heads, weight, eps)
    return apply_rope_signed(heads, cos, sin_signed)


@dataclass(frozen=True)
class RotaryTable:
    """cos, sin [P, D] in float32 for positions [0, P) (the default rope type). `signed_tables` keeps,
    per compute dtype, the tables `rope_for_step` indexes (made on first use, then reused)."""

    cos: Tensor
    sin: Tensor
    _signed: dict = field(default_factory=dict, compare=False, repr=False)

    def signed_tables(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """-> cos, signed sin [P, 1, D] in dtype (the first half of each sin row negated, as
        `apply_rope_signed` takes it): one index of each per step instead of six ops."""
        if dtype not in self._signed:
            half = self.sin.shape[-1] // 2
            signed = torch.cat([-self.sin[:, :half], self.sin[:, half:]], dim=-1)
            self._signed[dtype] = (self.cos.to(dtype)[:, None, :].contiguous(), signed.to(dtype)[:, None, :].contiguous())
        return self._signed[dtype]

    @classmethod
    def build(cls, head_dim: int, theta: float, max_positions: int) -> "RotaryTable":
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # [D/2]
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        return cls(cos=emb.cos(), sin=emb.sin())

    def for_positions(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [T] -> cos, sin [T, 1, D] in dtype (broadcast over heads)."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def rope_for_step(rope: RotaryTable, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, signed sin [T, 1, D] for `apply_rope_signed`, computed once per forward and shared by layers."""
    cos, sin_signed = rope.signed_tables(dtype)  # [P, 1, D] each
    return cos[positions], sin_signed[positions]


def apply_rope_signed(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """Same result as apply_rope with fewer ops: rotate_half(x) * sin == swap_halves(x) * signed sin.
    x [T, NH, D], cos / sin_signed [T, 1, D] -> [T, NH, D]."""
    swapped = torch.roll(x, x.shape[-1] // 2, -1)  # the two halves of D swapped, in one op
    return x * cos + swapped * sin_signed


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, NH, D], cos/sin [T, 1, D] -> [T, NH, D]."""
    return x * cos + rotate_half(x) * sin


def matmul_layout(w, pack: bool = True, dense_dtype: str | None = None):
    """w [out, in] -> the same values held as suits `linear(x, w)` best on the CPU:
    - with dense_dtype (see `kernels.prepare.prepare_dense`; "fp8": BlockwiseFP8 128x128 blocks, one
      matrix [1, out, in]) quantized into that format, or kept as stored where w comes quantized in it
      (an `FP8BlockExperts` read from a BlockwiseFP8 checkpoint), on any device (its bytes in 2 MiB
      pages on the CPU: `streamed`);
    - plain [out, in] contiguous where the compiled CPU kernels read it faster at decode sizes
      (`kernels.cpu.linear_cpu.holds_plain`): float32 with one torch thread (faster than [in, out] for
      MKL), bfloat16 where they multiply in bfloat16 dot products (AVX512-BF16); in 2 MiB pages
      where the system has them (`streamed`);
    - packed by oneDNN (`packed_for_linear`) where that applies: other bfloat16, float32 when torch
      runs 2 or more intra-op threads (only `linear` can use a packed tensor, so pack=False where the
      tensor is also indexed);
    - otherwise float32 is held [in, out] contiguous (returned as its [out, in] transposed view), since
      MKL's single-threaded float32 path reads that layout faster at one or a few rows (decode);
    - anything else is returned as is.
    A quantized w without dense_dtype (a stored FP8 matrix the caller did not dequantize) is kept as is."""
    if dense_dtype is not None:
        return streamed(prepare_dense(w, dense_dtype))
    if isinstance(w, QUANTIZED_TYPES):
        return w
    if w.device.type != "cpu" or w.dim() != 2:
        return w
    if holds_plain(w.dtype, w.device):
        return streamed(w.contiguous())
    packed = packed_for_linear(w) if pack else None
    if packed is not None:
        return packed
    if w.dtype == torch.float32:
        return w.t().contiguous().t()
    return w


def streamed(w):
    """A matrix each decode step reads in full, from memory (held plain, or BlockwiseFP8 [1, out, in]),
    with its bytes moved into 2 MiB pages where the system has them (`kernels.hugepages.huge_page_copy`:
    fewer TLB misses, no prefetch stop every 4 KiB; the sparse shape's decode steps 1.5-6% faster,
    docs/benchmarks.md); anything else, or where that does not apply, as is."""
    if isinstance(w, FP8BlockExperts):
        return dataclasses.replace(w, weight=huge_page_copy(w.weight))
    return huge_page_copy(w) if isinstance(w, Tensor) else w


def packed_for_linear(w: Tensor) -> Tensor | None:
    """w [out, in] on the CPU -> a oneDNN-packed copy for `linear`; None where that does not pay.
    bfloat16 always packs (oneDNN's blocked layout reads faster than any plain one at 1-16 rows);
    float32 packs only when torch runs >= 2 threads: oneDNN spreads these matrix sizes over both
    cores and MKL does not, while with one thread MKL's [in, out] layout is the faster one
    (figures: docs/benchmarks.md)."""
    if w.dim() != 2 or not packing_applies(w.dtype, w.device):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1)


def packing_applies(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `packed_for_linear` packs matrices of this dtype and device (see there)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.bfloat16 or (dtype == torch.float32 and torch.get_num_threads() >= 2)


def linear(x: Tensor, w) -> Tensor:
    """x [T, in] @ w[out, in].t() -> [T, out], for a plain w, one packed by `packed_for_linear`, or one
    held quantized by `matmul_layout(w, dense_dtype=...)` ([1, out, in]); on the compiled CPU kernels at
    decode sizes (`linear_cpu_variant`)."""
    if isinstance(w, QUANTIZED_TYPES):
        return quantized_linear(x, w)
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, None, "none", [], "")
    variant = linear_cpu_variant(x, w)
    if variant is not None:
        return run_linear(x, w, variant)
    return x @ w.t()


def biased_linear(x: Tensor, w, bias: Tensor | None) -> Tensor:
    """x [T, in] @ w[out, in].t() + bias [out] -> [T, out]: torch's F.linear for a plain w (as the models
    with biased projections always ran), `linear` then the bias for one held quantized."""
    if isinstance(w, QUANTIZED_TYPES):
        out = quantized_linear(x, w)
        return out if bias is None else out + bias
    return F.linear(x, w, bias)


def quantized_linear(x: Tensor, w) -> Tensor:
    """x [T, in] @ W.T for W [1, out, in] held quantized -> [T, out] in x.dtype. Up to
    `kernels.cpu.linear_cpu.MAX_QUANTIZED_ROWS` rows the compiled kernels read W's stored bytes in place
    (float32 accumulation). Above that (a long prefill), or where the compiled kernels do not run
    (another device, no compiled variant), W is dequantized into a copy in x.dtype and torch's matmul
    runs: the GEMV-shaped kernels are built for few rows (their work grows with every row), while the
    copy's cost is shared by a prefill's many rows and torch's GEMMs then run at their full rate."""
    args = quantized_linear_args(x, w)
    variant = selected_variant() if args is not None else None
    if variant is not None:
        return run_linear(x, w, variant, args)
    return x @ w.dequantize(x.dtype)[0].t()  # [T, in] @ [in, out]


def cat_rows(parts: list):
    """Matrices [N_i, K] stacked along rows (q | k | v, gate | up) -> [sum N_i, K]: torch.cat for tensors;
    BlockwiseFP8 matrices as stored ([1, N_i, K], a checkpoint read with dense_dtype "fp8") keep their
    bytes and scales (`kernels.formats.cat_fp8_rows`)."""
    if all(isinstance(p, Tensor) for p in parts):
        return torch.cat(parts)
    if all(isinstance(p, FP8BlockExperts) for p in parts):
        return cat_fp8_rows(parts)
    raise ValueError(f"cat_rows: parts stored in different formats ({', '.join(type(p).__name__ for p in parts)})")


def as_tensor(w, dtype: torch.dtype) -> Tensor:
    """w as a dense tensor in dtype: a weight that comes quantized as stored (read with dense_dtype
    "fp8") but is indexed or kept in the compute dtype (embedding, router) is dequantized."""
    if isinstance(w, QUANTIZED_TYPES):
        return w.dequantize(dtype)[0]
    return w


def held_bytes(w) -> int:
    """Bytes a weight held by `matmul_layout` occupies (a quantized one's data and scales; a packed
    tensor's elements)."""
    if w is None:
        return 0
    if isinstance(w, QUANTIZED_TYPES):
        return w.nbytes
    return w.numel() * w.element_size()


def silu_mlp(x: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """Dense SwiGLU MLP. x [T, H], gate_up [2I, H] (gate rows then up rows), down [H, I] -> [T, H]."""
    h = linear(x, gate_up)  # [T, 2I]
    inter = h.shape[-1] // 2
    return linear(F.silu(h[:, :inter]) * h[:, inter:], down)
