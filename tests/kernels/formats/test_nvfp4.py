import pytest
import torch

from kernels.formats import NVFP4Experts, cat_nvfp4, nvfp4_from_modelopt, quantize_nvfp4
from kernels.formats.checks import pad_last
from tests.kernels.oracles import ct_nvfp4, torchao_nvfp4


def _spread(shape, seed):
    torch.manual_seed(seed)
    return torch.randn(shape) * (0.5 + torch.rand(shape[0], 1))  # block amax well inside the e4m3 normal range


@pytest.mark.parametrize("shape", [(8, 64), (6, 48), (5, 40)])
def test_matches_torchao(shape):
    w = _spread(shape, sum(shape))
    scale, packed, pts, deq = torchao_nvfp4(pad_last(w, 16))
    q = quantize_nvfp4(w)
    assert q.weight_scale_2[0, 0].item() == pts.item()
    assert torch.equal(q.weight_scale[0].view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(q.weight[0], packed)
    assert torch.equal(q.dequantize(torch.float32)[0], deq[:, : shape[1]])


@pytest.mark.parametrize("shape", [(8, 64), (16, 32)])
def test_matches_compressed_tensors(shape):
    w = _spread(shape, 7 * sum(shape))
    scale, packed, global_scale, deq = ct_nvfp4(w)
    q = quantize_nvfp4(w)
    assert torch.equal(q.weight_scale[0].view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(q.weight[0], packed)
    # compressed-tensors stores 1/weight_scale_2 and divides by it: equal up to float rounding
    assert q.weight_scale_2[0, 0].item() == pytest.approx(1.0 / global_scale.item(), rel=1e-6)
    torch.testing.assert_close(q.dequantize()[0], deq, rtol=1e-6, atol=0)


def test_all_zero_tensor_and_zero_blocks():
    w = torch.zeros(2, 4, 32)
    w[1, 0, :16] = torch.linspace(-3.0, 3.0, 16)
    q = quantize_nvfp4(w)
    assert q.weight_scale_2[0, 0].item() == 1.0
    assert bool((q.weight_scale[0].float() == 1.0).all())
    assert q.weight_scale[1, 1, 1].float().item() == 1.0
    d = q.dequantize()
    assert torch.count_nonzero(d[0]).item() == 0 and torch.count_nonzero(d[1, 1:]).item() == 0
    assert d[1, 0, 0].item() == pytest.approx(-3.0, rel=1e-6) and d[1, 0, 15].item() == pytest.approx(3.0, rel=1e-6)


def test_saturation_keeps_the_tensor_max():
    w = torch.randn(1, 8, 32) * 0.01
    w[0, 3, 5] = 50.0
    d = quantize_nvfp4(w).dequantize()
    assert d[0, 3, 5].item() == pytest.approx(50.0, rel=1e-6)
    assert float(d.abs().max()) == pytest.approx(50.0, rel=1e-6)


def test_segments_have_their_own_global_scale():
    torch.manual_seed(3)
    gate, up = torch.randn(3, 8, 32), torch.randn(3, 8, 32) * 10
    fused = quantize_nvfp4(torch.cat([gate, up], dim=1), segments=2)
    parts = cat_nvfp4([quantize_nvfp4(gate), quantize_nvfp4(up)])
    assert fused.weight_scale_2.shape == (3, 2)
    assert torch.equal(fused.weight_scale_2, parts.weight_scale_2)
    assert torch.equal(fused.dequantize(), parts.dequantize())


def test_round_trip_is_idempotent():
    w = _spread((12, 80), 5)
    q = quantize_nvfp4(w)
    again = quantize_nvfp4(q.dequantize())
    assert torch.equal(again.weight, q.weight)
    torch.testing.assert_close(again.dequantize(), q.dequantize(), rtol=1e-6, atol=0)


def test_modelopt_loader_keeps_values_as_stored():
    w = _spread((8, 64), 9)
    scale, packed, pts, deq = torchao_nvfp4(w)
    loaded = nvfp4_from_modelopt(packed, scale, pts, input_scale=torch.tensor(0.5))
    assert loaded.shape == (1, 8, 64) and loaded.input_scale.item() == 0.5
    assert torch.equal(loaded.dequantize()[0], deq)


def test_rejects_bad_input():
    w = torch.randn(4, 32)
    w[2, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_nvfp4(w)
    packed = torch.zeros(1, 4, 16, dtype=torch.uint8)
    scale = torch.ones(1, 4, 2).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="weight_scale_2"):
        nvfp4_from_modelopt(packed, scale, torch.tensor([0.0]))
    with pytest.raises(ValueError, match="weight_scale"):
        NVFP4Experts(packed, torch.ones(1, 4, 3).to(torch.float8_e4m3fn), torch.ones(1, 1), 32)
    with pytest.raises(ValueError, match="weight"):
        nvfp4_from_modelopt(packed.float(), scale, torch.tensor([1.0]))


def test_many_slabs_of_rows_match_torchao_per_expert_and_segment(monkeypatch):
    # small slabs force both row-slab passes through many iterations, across segment boundaries
    monkeypatch.setattr("kernels.formats.checks.CHUNK_ELEMENTS", 100)
    w = _spread((3 * 12, 40), 11).reshape(3, 12, 40)
    q = quantize_nvfp4(w, segments=2)
    for e in range(3):
        for s in range(2):
            scale, packed, pts, _ = torchao_nvfp4(pad_last(w[e, 6 * s : 6 * (s + 1)], 16))
            assert q.weight_scale_2[e, s].item() == pts.item()
            assert torch.equal(q.weight_scale[e, 6 * s : 6 * (s + 1)].view(torch.uint8), scale.view(torch.uint8))
            assert torch.equal(q.weight[e, 6 * s : 6 * (s + 1)], packed)
