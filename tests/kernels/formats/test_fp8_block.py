import pytest
import torch

from kernels.formats import cat_fp8_block, cat_fp8_rows, fp8_block_from_checkpoint, permute_fp8_rows, quantize_fp8_block
from tests.kernels.oracles import ct_fp8_block


@pytest.mark.parametrize("shape", [(256, 256), (300, 200), (64, 72), (129, 1)])
def test_matches_compressed_tensors_including_edge_blocks(shape):
    torch.manual_seed(sum(shape))
    w = torch.randn(shape) * torch.rand(shape[0], 1) * 5
    scale, q, deq = ct_fp8_block(w)
    ours = quantize_fp8_block(w)
    assert torch.equal(ours.scale[0], scale)
    assert torch.equal(ours.weight[0].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(ours.dequantize(torch.float32)[0], deq)


def test_segments_are_blocked_like_separate_projections():
    torch.manual_seed(1)
    gate, up = torch.randn(2, 200, 136), torch.randn(2, 200, 136) * 3  # 200 rows: partial last block in each
    fused = quantize_fp8_block(torch.cat([gate, up], dim=1), segments=2)
    parts = cat_fp8_block([quantize_fp8_block(gate), quantize_fp8_block(up)])
    assert fused.segments == 2 and fused.scale.shape == (2, 4, 2)
    assert torch.equal(fused.scale, parts.scale)
    assert torch.equal(fused.dequantize(), parts.dequantize())
    s, _, deq = ct_fp8_block(up[1])
    assert torch.equal(fused.scale[1, 2:], s)
    assert torch.equal(fused.dequantize()[1, 200:], deq)


def test_round_trip_error_is_within_half_an_e4m3_step():
    torch.manual_seed(2)
    w = torch.randn(3, 130, 260)
    q = quantize_fp8_block(w)
    rel = ((q.dequantize() - w).abs() / w.abs().clamp(min=1e-3)).max()
    assert rel <= 2.0**-4 + 1e-6  # 3 mantissa bits: relative rounding error at most 2^-4 for normals
    again = quantize_fp8_block(q.dequantize())
    assert torch.equal(again.weight.view(torch.uint8), q.weight.view(torch.uint8))


def test_all_zero_block_and_saturation():
    w = torch.zeros(1, 256, 256)
    w[0, 128:, 128:] = torch.randn(128, 128)
    w[0, 200, 200] = 1e6
    q = quantize_fp8_block(w)
    assert q.scale[0, 0, 0].item() == 1.0 and q.scale[0, 0, 1].item() == 1.0
    assert torch.count_nonzero(q.dequantize()[0, :128]).item() == 0
    assert q.weight[0, 200, 200].float().item() == 448.0
    assert q.dequantize()[0, 200, 200].item() == pytest.approx(1e6, rel=1e-6)


def test_ue8m0_scales_are_powers_of_two_and_cover_amax():
    torch.manual_seed(3)
    w = torch.randn(2, 256, 384) * 7
    q = quantize_fp8_block(w, scale_fmt="ue8m0")
    m, _ = torch.frexp(q.scale)
    assert bool((m == 0.5).all())
    assert float(q.weight.float().abs().max()) <= 448.0
    assert ((q.dequantize() - w).abs() <= w.abs() * 2.0**-4 + q.scale.max() * 2.0**-9).all()


def test_loader_keeps_values_as_stored():
    torch.manual_seed(4)
    w = torch.randn(300, 200)
    scale, q, deq = ct_fp8_block(w)
    loaded = fp8_block_from_checkpoint(q, scale)
    assert loaded.shape == (1, 300, 200)
    assert torch.equal(loaded.dequantize()[0], deq)
    stacked = fp8_block_from_checkpoint(torch.stack([q, q]), torch.stack([scale, scale]).to(torch.bfloat16))
    assert stacked.scale.dtype == torch.float32 and stacked.shape == (2, 300, 200)


def test_loader_widens_ue8m0_scales_exactly():
    torch.manual_seed(5)
    q = quantize_fp8_block(torch.randn(2, 200, 130) * 3, scale_fmt="ue8m0")
    e8m0 = (torch.log2(q.scale).round() + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    loaded = fp8_block_from_checkpoint(q.weight, e8m0)
    assert torch.equal(loaded.scale, q.scale)
    assert torch.equal(loaded.dequantize(), q.dequantize())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_rejects_non_finite_input(bad):
    w = torch.randn(4, 8)
    w[1, 2] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_fp8_block(w)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="w"):
        quantize_fp8_block(torch.zeros(4, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="segments"):
        quantize_fp8_block(torch.zeros(5, 8), segments=2)
    with pytest.raises(ValueError, match="scale_fmt"):
        quantize_fp8_block(torch.zeros(4, 8), scale_fmt="e5m2")
    q = torch.zeros(300, 200).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale"):
        fp8_block_from_checkpoint(q, torch.ones(2, 2))
    with pytest.raises(ValueError, match="weight_scale_inv"):
        fp8_block_from_checkpoint(q, torch.full((3, 2), float("nan")))
    with pytest.raises(ValueError, match="weight"):
        fp8_block_from_checkpoint(torch.zeros(300, 200), torch.ones(3, 2))


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_many_slabs_of_block_rows_give_the_same_bytes(monkeypatch, scale_fmt):
    # partial blocks at both edges, 2 segments, 3 experts: one slab per segment, then many small ones
    torch.manual_seed(9)
    w = (torch.randn(3, 2 * 40, 70) * torch.rand(3, 2 * 40, 1) * 5).to(torch.bfloat16)
    whole = quantize_fp8_block(w, block=(16, 32), segments=2, scale_fmt=scale_fmt)
    monkeypatch.setattr("kernels.formats.checks.CHUNK_ELEMENTS", 100)
    slabs = quantize_fp8_block(w, block=(16, 32), segments=2, scale_fmt=scale_fmt)
    assert torch.equal(slabs.weight.view(torch.uint8), whole.weight.view(torch.uint8))
    assert torch.equal(slabs.scale, whole.scale)
    ref = torch.cat([quantize_fp8_block(w[:, s * 40 : (s + 1) * 40], block=(16, 32), scale_fmt=scale_fmt).dequantize() for s in range(2)], dim=1)
    assert torch.equal(slabs.dequantize(), ref)


@pytest.mark.parametrize(
    "rows,block",
    [((64, 32, 32), (32, 32)), ((64, 32, 32), (128, 128)), ((192, 64, 64), (128, 128)), ((256, 128, 128), (128, 128)),
     ((80, 16, 16), (32, 32)), ((96, 96), (64, 64))],
)
def test_cat_fp8_rows_keeps_bytes_and_values(rows, block):
    """q | k | v of different row counts joined as stored: same bytes, same dequantized values (segments
    of whole blocks, or within one block whose scale row is copied)."""
    torch.manual_seed(sum(rows))
    parts = [quantize_fp8_block(torch.randn(r, 100) * torch.rand(r, 1), block=block) for r in rows]
    joined = cat_fp8_rows(parts)
    assert joined.shape == (1, sum(rows), 100)
    assert torch.equal(joined.weight.view(torch.uint8), torch.cat([p.weight for p in parts], dim=1).view(torch.uint8))
    want = torch.cat([p.dequantize(torch.float32) for p in parts], dim=1)
    assert torch.equal(joined.dequantize(torch.float32), want)


def test_cat_fp8_rows_refuses_mixed_blocks_and_stacks():
    a, b = quantize_fp8_block(torch.randn(32, 64), block=(32, 32)), quantize_fp8_block(torch.randn(32, 64))
    with pytest.raises(ValueError, match="same block"):
        cat_fp8_rows([a, b])
    with pytest.raises(ValueError, match="one matrix"):
        cat_fp8_rows([quantize_fp8_block(torch.randn(2, 32, 64))])
    with pytest.raises(ValueError, match="empty"):
        cat_fp8_rows([])


def test_permute_fp8_rows_within_blocks_keeps_values_and_refuses_crossing_rows():
    torch.manual_seed(9)
    w = quantize_fp8_block(torch.randn(64, 40), block=(32, 32))
    index = torch.cat([torch.randperm(16) + 16 * h for h in range(4)])  # per 16-row head, inside 32-row blocks
    moved = permute_fp8_rows(w, index)
    assert torch.equal(moved.dequantize(torch.float32)[0], w.dequantize(torch.float32)[0][index])
    assert torch.equal(moved.scale, w.scale)
    with pytest.raises(ValueError, match="across FP8 blocks"):
        permute_fp8_rows(w, torch.arange(64).roll(16))
