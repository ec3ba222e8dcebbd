"""Expert weight memory in 2 MiB transparent huge pages (used by bench/kernel_ab.py --pages; the
checkpoint loader keeps 4 KiB pages: faulting huge pages in at load measured far slower here, see
docs/benchmarks.md).

A decode step reads each selected expert's bytes once, from memory: over 4 KiB pages every 4 KiB of
weights costs a TLB entry (and, after the step's other work has evicted them, a page walk), and the
hardware prefetchers stop at each page's end. `to_huge_pages(t)` asks the kernel to back the 2 MiB
-aligned part of a tensor's memory with huge pages, in place: `madvise(MADV_HUGEPAGE)` (so the range
stays eligible) and `madvise(MADV_COLLAPSE)` (Linux 6.1+: the kernel copies each 2 MiB range into a
huge page now, without the process holding a second copy). Where transparent huge pages are
turned off, the kernel is older or the call fails, the memory stays as it was: nothing raises.

Only the aligned interior is covered: a tensor under 2 MiB, or the up-to-2 MiB edges of a larger one,
keep 4 KiB pages.
"""
from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def _madvise():
    """libc's madvise, or None off Linux or where transparent huge pages are turned off."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        if "[never]" in THP_SETTING.read_text():
            return None
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def huge_range(t: torch.Tensor) -> tuple[int, int] | None:
    """(address, length) of the 2 MiB-aligned part of t's storage bytes, or None when it holds no
    whole huge page."""
    begin = t.untyped_storage().data_ptr()
    end = begin + t.untyped_storage().nbytes()
    lo = -(-begin // HUGE_PAGE) * HUGE_PAGE
    hi = end // HUGE_PAGE * HUGE_PAGE
    return (lo, hi - lo) if hi > lo else None


def to_huge_pages(t: torch.Tensor) -> int:
    """Backs the aligned interior of t's (CPU) storage with huge pages, in place; the values do not
    change. Returns the bytes the kernel was asked to collapse (0 where nothing was asked or it
    refused)."""
    madvise = _madvise()
    if madvise is None or t.device.type != "cpu":
        return 0
    span = huge_range(t)
    if span is None:
        return 0
    addr, length = span
    if madvise(addr, length, MADV_HUGEPAGE) != 0:
        return 0
    return length if madvise(addr, length, MADV_COLLAPSE) == 0 else 0


def weight_tensors(obj) -> list[torch.Tensor]:
    """The tensors a projection holds: itself (dense) or the fields of a quantized format."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    return [v for v in vars(obj).values() if isinstance(v, torch.Tensor)] if obj is not None else []


def experts_in_huge_pages(w):
    """`to_huge_pages` on every tensor of an ExpertWeights' projections (dense or quantized); returns w."""
    for proj in (w.gate_up, w.down):
        for t in weight_tensors(proj):
            to_huge_pages(t)
    return w
