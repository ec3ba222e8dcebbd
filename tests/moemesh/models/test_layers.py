import torch

from moemesh.models.layers import linear, matmul_layout


def test_matmul_layout_keeps_the_products():
    x = torch.randn(3, 4)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(6, 4).to(dtype)
        held = matmul_layout(w)
        assert held.shape == (6, 4)
        torch.testing.assert_close(linear(x.to(dtype), held), x.to(dtype) @ w.t())
    w = torch.randn(6, 4)
    assert matmul_layout(w).t().is_contiguous()  # float32 is stored [in, out]
    b = torch.randn(6, 4).bfloat16()
    assert matmul_layout(b, pack=False) is b  # kept indexable
    assert matmul_layout(b).is_mkldnn == torch.backends.mkldnn.is_available()
