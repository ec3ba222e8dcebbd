"""kernels.hugepages: weights moved into huge pages keep their values, wherever the kernel grants them;
copies own their memory and leave what they do not apply to alone."""
import gc
import weakref

import pytest
import torch

from kernels import ExpertWeights, hugepages, prepare_experts
from kernels.hugepages import HUGE_PAGE, experts_in_huge_pages, huge_page_copy, huge_range, to_huge_pages, weight_tensors

THP = hugepages.available()


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_huge_range_is_the_aligned_interior():
    t = torch.empty(3 * HUGE_PAGE + 100, dtype=torch.uint8)
    addr, length = huge_range(t)
    begin = t.untyped_storage().data_ptr()
    assert addr % HUGE_PAGE == 0 and length % HUGE_PAGE == 0
    assert begin <= addr and addr + length <= begin + t.untyped_storage().nbytes()
    assert length >= 2 * HUGE_PAGE
    assert huge_range(torch.empty(HUGE_PAGE // 2, dtype=torch.uint8)) is None


def test_to_huge_pages_keeps_the_values():
    t = torch.randn(3 * HUGE_PAGE // 4).to(torch.bfloat16)
    before = t.clone()
    asked = to_huge_pages(t)
    assert asked % HUGE_PAGE == 0 and asked <= t.untyped_storage().nbytes()
    assert torch.equal(t, before)
    assert to_huge_pages(torch.ones(10)) == 0  # below a huge page: nothing asked


def test_experts_in_huge_pages_keeps_every_format():
    g = torch.Generator().manual_seed(0)
    dense = ExpertWeights(torch.randn(4, 2 * 256, 1024, generator=g), torch.randn(4, 1024, 256, generator=g))
    for fmt in ("bf16", "fp8", "mxfp4", "nvfp4"):
        w = prepare_experts(dense, fmt, torch.bfloat16)
        before = [t.clone() for p in (w.gate_up, w.down) for t in weight_tensors(p)]
        assert experts_in_huge_pages(w) is w
        after = [t for p in (w.gate_up, w.down) for t in weight_tensors(p)]
        assert len(after) == len(before) and all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(after, before))


@pytest.mark.skipif(not THP, reason="no transparent huge pages on this system (/sys/kernel/mm/transparent_hugepage)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_huge_page_copy_is_a_page_aligned_advised_copy_with_the_values(dtype):
    w = torch.randn(1536, 1024).to(dtype)  # 3 or 6 MiB
    held = huge_page_copy(w)
    assert held.data_ptr() != w.data_ptr() and torch.equal(held, w)
    assert held.shape == w.shape and held.dtype == dtype and held.is_contiguous() and held.storage_offset() == 0
    assert held.data_ptr() % HUGE_PAGE == 0
    assert "hg" in vm_flags(held.data_ptr())  # MADV_HUGEPAGE: the kernel backs it with 2 MiB pages where it can
    assert "hg" in vm_flags(held.data_ptr() + held.numel() * held.element_size() - 1)  # to its last byte


@pytest.mark.skipif(not THP, reason="no transparent huge pages on this system")
def test_huge_page_copy_owns_its_memory_and_releases_it_with_the_tensor():
    w = torch.randn(HUGE_PAGE // 4 + 7)  # just over 2 MiB of float32, not a multiple of the page
    held = huge_page_copy(w[1:])  # from a view at an offset
    expected = w[1:].clone()
    del w
    gc.collect()
    assert torch.equal(held, expected)  # still readable: the tensor holds the mapping
    held.mul_(2)  # and writable
    assert torch.equal(held, expected * 2)
    ref = weakref.ref(held.untyped_storage())
    del held
    gc.collect()
    assert ref() is None


def test_huge_page_copy_returns_what_it_does_not_apply_to_as_is(monkeypatch):
    small = torch.randn(HUGE_PAGE // 4 - 1)  # one float short of 2 MiB
    assert huge_page_copy(small) is small
    big = torch.randn(HUGE_PAGE // 4)
    monkeypatch.setattr(hugepages, "_madvise", lambda: None)  # transparent huge pages off, or not Linux
    assert huge_page_copy(big) is big
