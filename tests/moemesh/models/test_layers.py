import pytest
import torch

from moemesh.models.layers import linear, matmul_layout


@pytest.fixture
def threads():
    """Sets torch's intra-op threads for one test (the float32 layout depends on it)."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("n", [1, 2])
def test_matmul_layout_keeps_the_products(threads, n):
    threads(n)
    x = torch.randn(3, 4)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(6, 4).to(dtype)
        held = matmul_layout(w)
        assert held.shape == (6, 4)
        torch.testing.assert_close(linear(x.to(dtype), held), x.to(dtype) @ w.t())


def test_float32_is_held_in_out_with_one_thread_and_packed_with_two(threads):
    w = torch.randn(6, 4)
    threads(1)
    assert matmul_layout(w).t().is_contiguous()  # [in, out] for MKL
    threads(2)
    assert matmul_layout(w).is_mkldnn == torch.backends.mkldnn.is_available()
    assert matmul_layout(w, pack=False).t().is_contiguous()  # kept indexable


def test_bfloat16_is_packed_unless_it_must_stay_indexable():
    b = torch.randn(6, 4).bfloat16()
    assert matmul_layout(b, pack=False) is b
    assert matmul_layout(b).is_mkldnn == torch.backends.mkldnn.is_available()
