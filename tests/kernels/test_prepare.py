"""`prepare_dense`: a dense linear's weight held in `dense_dtype`, checked against compressed-tensors."""
import pytest
import torch

from kernels.formats import FP8BlockExperts, quantize_mxfp4
from kernels.prepare import DENSE_DTYPES, check_dense_dtype, prepare_dense
from tests.kernels.oracles import ct_fp8_block


@pytest.mark.parametrize("shape", [(1536, 1024), (200, 300), (64, 72)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_dense_weight_matches_compressed_tensors(shape, dtype):
    torch.manual_seed(shape[0])
    w = (torch.randn(shape) * torch.rand(shape[0], 1) * 0.2).to(dtype)
    scale, q, deq = ct_fp8_block(w)  # 128 x 128 blocks, edge blocks partial
    held = prepare_dense(w, "fp8")
    assert isinstance(held, FP8BlockExperts) and held.shape == (1, *shape) and held.block == (128, 128)
    assert torch.equal(held.scale[0], scale)
    assert torch.equal(held.weight[0].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(held.dequantize(torch.float32)[0], deq)


def test_stored_fp8_is_kept_and_other_formats_refused():
    stored = prepare_dense(torch.randn(40, 64), "fp8")
    assert prepare_dense(stored, "fp8") is stored  # nothing re-quantized
    with pytest.raises(ValueError, match="mxfp4"):
        prepare_dense(quantize_mxfp4(torch.randn(1, 32, 64)), "fp8")


@pytest.mark.parametrize("bad", ["int8", "bf16", "FP8", ""])
def test_bad_dense_dtype_names_the_field(bad):
    with pytest.raises(ValueError, match="dense_dtype"):
        check_dense_dtype(bad)
    with pytest.raises(ValueError, match="dense_dtype"):
        prepare_dense(torch.randn(4, 4), bad)
    check_dense_dtype(None)
    assert DENSE_DTYPES == ("fp8",)
