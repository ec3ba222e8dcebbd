import torch

from moemesh.models.layers import matmul_layout


def test_matmul_layout_keeps_values_and_shape():
    w = torch.randn(6, 4)
    held = matmul_layout(w)
    assert held.shape == (6, 4) and torch.equal(held, w)
    assert held.t().is_contiguous()  # float32 is stored [in, out]
    x = torch.randn(3, 4)
    torch.testing.assert_close(x @ held.t(), x @ w.t())
    b = w.bfloat16()
    assert matmul_layout(b) is b  # other dtypes stay [out, in]
