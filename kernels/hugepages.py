"""Weight memory in 2 MiB transparent huge pages.

A decode step reads each matrix it uses once, from memory: over 4 KiB pages every 4 KiB of weights
costs a TLB entry (and, after the step's other work has evicted them, a page walk), and the hardware
prefetchers stop at each page's end.

- `huge_page_copy(t)`: t's values in new memory that starts on a 2 MiB boundary and is advised
  `MADV_HUGEPAGE` before anything touches it, so the kernel backs all of it with huge pages as the
  copy faults it in. The checkpoint loader holds the dense matrices the compiled CPU kernels read
  plain this way (`moemesh.models.layers.matmul_layout`): on the sparse shape the attention
  matrices read 1.16-1.22x faster and the LM head 1.11-1.19x, decode steps 2-6% faster, for
  0.25-0.45 s more load (docs/benchmarks.md).
- `to_huge_pages(t)`: asks the kernel to back the 2 MiB-aligned part of a tensor's memory with huge
  pages, in place: `madvise(MADV_HUGEPAGE)` (so the range stays eligible) and
  `madvise(MADV_COLLAPSE)` (Linux 6.1+: the kernel copies each 2 MiB range into a huge page now,
  without the process holding a second copy). Only the aligned interior is covered: a tensor under
  2 MiB, or the up-to-2 MiB edges of a larger one, keep 4 KiB pages. Used by bench/kernel_ab.py
  --pages for the experts, which the loader keeps in 4 KiB pages: faulting 2.4 GB of huge pages in
  at load measured 3-7 s slower here (a virtual machine whose host backs fresh memory on first
  touch), for 4-6% faster expert calls.

Where transparent huge pages are turned off, the kernel is older or a call fails, the memory stays as
it was: nothing raises.
"""
from __future__ import annotations

import ctypes
import functools
import mmap
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


def available() -> bool:
    """Whether this system turns transparent huge pages on for memory advised MADV_HUGEPAGE (Linux,
    not "never"): where not, `huge_page_copy` and `to_huge_pages` leave memory as it is."""
    return _madvise() is not None


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


def huge_page_copy(t: torch.Tensor) -> torch.Tensor:
    """t's values as a new contiguous CPU tensor (same shape and dtype) whose memory starts on a 2 MiB
    boundary and was advised MADV_HUGEPAGE untouched; t itself where that does not apply (not the
    CPU, under 2 MiB, no transparent huge pages here). The tensor owns the mapping: it is released
    with the tensor's storage."""
    madvise = _madvise()
    n = t.numel() * t.element_size()
    if madvise is None or t.device.type != "cpu" or n < HUGE_PAGE:
        return t
    pages = -(-n // HUGE_PAGE) * HUGE_PAGE  # the last huge page whole too (its unused part is zeros)
    region = mmap.mmap(-1, pages + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # no memory behind it yet
    start = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    offset = -start % HUGE_PAGE
    if madvise(start + offset, pages, MADV_HUGEPAGE) != 0:
        return t
    # the storage holds a reference to `region` (frombuffer keeps the buffer alive)
    out = torch.frombuffer(region, dtype=torch.uint8, count=n, offset=offset).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


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
