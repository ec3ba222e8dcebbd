"""Input checks shared by the weight formats: every failure is a ValueError naming the argument.

Shape legend: E experts, N output rows, K reduction dim.
"""
from __future__ import annotations

import torch
from torch import Tensor

FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)


# Quantizers work through a weight in slabs of about this many elements (whole rows, or whole block
# rows), so that every temporary of the float32 arithmetic stays a few MiB (cache-sized, and no
# full-size float32 copy of the weight is ever made).
CHUNK_ELEMENTS = 1 << 20


def check_dense_weight(w: Tensor, name: str = "w") -> Tensor:
    """Accept [E, N, K] (or [N, K], treated as E=1) float weights; return [E, N, K] in their own dtype
    (no copy). Finiteness is checked by the quantizers on the block maxima they compute anyway
    (`check_finite`): a NaN or inf anywhere makes its block's maximum non-finite."""
    if not isinstance(w, Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in FLOAT_INPUTS:
        raise ValueError(f"{name}: expected one of {FLOAT_INPUTS}, got {w.dtype}")
    if w.dim() == 2:
        w = w.unsqueeze(0)
    if w.dim() != 3 or w.numel() == 0:
        raise ValueError(f"{name}: expected a non-empty [E, N, K] or [N, K] tensor, got shape {tuple(w.shape)}")
    return w


def check_finite(amax: Tensor, name: str = "w") -> None:
    """amax: maxima of |w| over blocks (NaN or inf where a block holds one) -> ValueError unless all finite."""
    require_finite(bool(torch.isfinite(amax).all()), name)


def require_finite(finite: bool, name: str = "w") -> None:
    """The ValueError of a weight that holds NaN or inf, unless `finite` (as a compiled quantizer reports it)."""
    if not finite:
        raise ValueError(f"{name}: contains NaN or inf; quantized formats only hold finite weights")


def abs_max(x: Tensor) -> Tensor:
    """x [..., B] -> max |x| over the last dim [...], in one pass over x (NaN propagates)."""
    lo, hi = torch.aminmax(x, dim=-1)
    return torch.maximum(hi, lo.neg_())


def row_chunks(rows: int, row_elements: int, multiple: int = 1) -> list[slice]:
    """Split `rows` rows of `row_elements` elements into slices of whole rows, each a multiple of
    `multiple` rows (but the last) holding about CHUNK_ELEMENTS elements."""
    step = max(1, CHUNK_ELEMENTS // max(1, row_elements * multiple)) * multiple
    return [slice(r, min(rows, r + step)) for r in range(0, rows, step)]


def check_segments(rows: int, segments: int, name: str = "segments") -> int:
    """Rows are split into `segments` equal parts (gate | up); return the rows per segment."""
    if not isinstance(segments, int) or segments < 1 or rows % segments:
        raise ValueError(f"{name}: must be a positive divisor of the row count {rows}, got {segments!r}")
    return rows // segments


def check_dtype(t: Tensor, dtype: torch.dtype, name: str) -> None:
    if not isinstance(t, Tensor) or t.dtype != dtype:
        got = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected {dtype}, got {got}")


def check_shape(t: Tensor, shape: tuple[int, ...], name: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")


def pad_last(x: Tensor, multiple: int) -> Tensor:
    """Zero-pad the last dim of x up to a multiple of `multiple`."""
    pad = (-x.shape[-1]) % multiple
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def expert_rows(t: Tensor, experts: Tensor | None, view: bool = False) -> Tensor:
    """t [E, ...] -> t[experts] (all experts when `experts` is None). float8 tensors are gathered as
    bytes (torch's float8 index_select is a slow generic path on CPU). view=True returns a view of t
    when the experts are consecutive and ascending (for reading only: a view keeps all of t alive)."""
    if experts is None:
        return t
    idx = experts.to(device=t.device, dtype=torch.long)
    if view and idx.numel() and idx.dim() == 1:
        first, n = int(idx[0]), idx.numel()
        if n == 1 or bool((idx == torch.arange(first, first + n, device=t.device)).all()):
            if 0 <= first and first + n <= t.shape[0]:
                return t.narrow(0, first, n)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8).index_select(0, idx).view(t.dtype)
    return t.index_select(0, idx)
