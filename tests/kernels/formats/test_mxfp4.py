import pytest
import torch

from kernels.formats import MXFP4Experts, cat_mxfp4, mxfp4_from_gpt_oss, quantize_mxfp4
from kernels.formats.checks import pad_last
from tests.kernels.oracles import torchao_mxfp4_floor


@pytest.mark.parametrize("shape", [(8, 64), (5, 96), (7, 40), (3, 1)])
def test_matches_torchao_floor_including_edge_blocks(shape):
    torch.manual_seed(sum(shape))
    w = torch.randn(shape) * torch.rand(shape[0], 1) * 10
    scales, packed, deq = torchao_mxfp4_floor(pad_last(w, 32))  # zero padding leaves every amax unchanged
    q = quantize_mxfp4(w)
    assert q.shape == (1, *shape)
    assert torch.equal(q.scales[0], scales)
    assert torch.equal(q.blocks[0].flatten(-2), packed)
    assert torch.equal(q.dequantize(torch.float32)[0], deq[:, : shape[1]])


def test_all_zero_blocks_and_saturation_match_torchao():
    w = torch.zeros(2, 96)
    w[1, 32:64] = torch.linspace(-7.9, 7.9, 32)  # amax 7.9: scale 2^0, elements above 6 saturate
    w[1, 64] = 1e-3
    scales, packed, deq = torchao_mxfp4_floor(w)
    q = quantize_mxfp4(w)
    assert q.scales[0, 0].tolist() == [0, 0, 0] and q.scales[0, 1, 1].item() == 127
    assert torch.equal(q.scales[0], scales) and torch.equal(q.blocks[0].flatten(-2), packed)
    d = q.dequantize()[0]
    assert torch.equal(d, deq)
    assert d[1, 32].item() == -6.0 and d[1, 63].item() == 6.0 and torch.count_nonzero(d[0]).item() == 0


def test_round_trip_is_idempotent_and_bounded():
    torch.manual_seed(1)
    w = torch.randn(3, 16, 70)
    q = quantize_mxfp4(w)
    d = q.dequantize()
    again = quantize_mxfp4(d)
    assert torch.equal(again.blocks, q.blocks) and torch.equal(again.scales, q.scales)
    # per block: amax < 8 * scale, saturation at 6 * scale: error below 2 * scale
    err = (pad_last(d - w, 32)).abs().unflatten(-1, (-1, 32)).amax(-1)
    assert bool((err < 2.0 * torch.exp2(q.scales.float() - 127)).all())


def test_bf16_input_is_accepted():
    w = torch.randn(4, 64).to(torch.bfloat16)
    assert torch.equal(quantize_mxfp4(w).dequantize(), quantize_mxfp4(w.float()).dequantize())


def test_gpt_oss_loader_deinterleaves_gate_up():
    torch.manual_seed(2)
    gate, up = torch.randn(2, 6, 64), torch.randn(2, 6, 64)
    interleaved = torch.stack([gate, up], dim=2).reshape(2, 12, 64)  # rows g0 u0 g1 u1 ...
    q = quantize_mxfp4(interleaved)
    loaded = mxfp4_from_gpt_oss(q.blocks, q.scales, interleaved_gate_up=True)
    assert loaded.segments == 2
    d = loaded.dequantize()
    assert torch.equal(d[:, :6], quantize_mxfp4(gate).dequantize())
    assert torch.equal(d[:, 6:], quantize_mxfp4(up).dequantize())
    plain = mxfp4_from_gpt_oss(q.blocks, q.scales, k=60)
    assert plain.shape == (2, 12, 60) and torch.equal(plain.dequantize(), q.dequantize()[..., :60])
    both = cat_mxfp4([quantize_mxfp4(gate), quantize_mxfp4(up)])
    assert torch.equal(both.dequantize(), d)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_rejects_non_finite_input(bad):
    w = torch.randn(4, 32)
    w[0, 0] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_mxfp4(w)


def test_rejects_bad_stored_tensors():
    blocks = torch.zeros(1, 4, 2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="scales"):
        mxfp4_from_gpt_oss(blocks, torch.full((1, 4, 2), 255, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scales"):
        MXFP4Experts(blocks, torch.zeros(1, 4, 3, dtype=torch.uint8), 64)
    with pytest.raises(ValueError, match="k"):
        MXFP4Experts(blocks, torch.zeros(1, 4, 2, dtype=torch.uint8), 20)
    with pytest.raises(ValueError, match="blocks"):
        mxfp4_from_gpt_oss(blocks.float(), torch.zeros(1, 4, 2, dtype=torch.uint8))


def test_many_slabs_of_rows_match_torchao_per_expert(monkeypatch):
    # small slabs force the row-slab loop through many iterations, with a partial last slab
    monkeypatch.setattr("kernels.formats.checks.CHUNK_ELEMENTS", 200)
    torch.manual_seed(5)
    w = torch.randn(3, 13, 70).to(torch.bfloat16)
    q = quantize_mxfp4(w)
    for e in range(3):
        scales, packed, _ = torchao_mxfp4_floor(pad_last(w[e].float(), 32))
        assert torch.equal(q.scales[e], scales) and torch.equal(q.blocks[e].flatten(-2), packed)
