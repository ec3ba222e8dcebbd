"""kernels.hugepages: weights moved into huge pages keep their values, wherever the kernel grants them."""
import torch

from kernels import ExpertWeights, prepare_experts
from kernels.hugepages import HUGE_PAGE, experts_in_huge_pages, huge_range, to_huge_pages, weight_tensors


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
