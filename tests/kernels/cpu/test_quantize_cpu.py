"""The compiled quantizers (kernels.cpu.quantize_cpu, behind kernels.formats' quantize_* on the CPU)
against the torch code of kernels/formats (MOEMESH_CPU_KERNEL=torch): the same stored bytes and scales
on random weights of several shapes and magnitudes, the edge values of the encodings, and the same
ValueError for non-finite weights."""
import pytest
import torch

from kernels.cpu import quantize_cpu
from kernels.cpu.variant import VARIANT_ENV, available_variants
from kernels.formats import quantize_fp8_block, quantize_mxfp4, quantize_nvfp4

DTYPES = [torch.float32, torch.bfloat16]
# [E, N, K] (or [N, K]): K a multiple of the blocks, K with a partial last block, K below one block,
# N not a multiple of FP8's 128 rows
SHAPES = [(2, 16, 64), (3, 10, 70), (1, 5, 1), (12, 40), (2, 136, 200), (1, 4, 300)]
TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # halfway between neighbouring E2M1 magnitudes


@pytest.fixture(autouse=True)
def compiled_or_skip():
    if not available_variants():
        pytest.skip("the compiled CPU kernels do not run here")


def both(quantize, w, monkeypatch, **kw):
    """(torch path result, compiled path result) of quantize(w, **kw)."""
    monkeypatch.setenv(VARIANT_ENV, "torch")
    want = quantize(w, **kw)
    monkeypatch.setenv(VARIANT_ENV, "auto")
    return want, quantize(w, **kw)


def spread(shape, dtype, seed, lo=-140, hi=120):
    """Random weights whose rows (and row blocks) span magnitudes 2^lo .. 2^hi (float32 subnormals
    included), with exact zeros and -0 mixed in."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    scale = torch.exp2(torch.randint(lo, hi, (*shape[:-1], 1), generator=g).float())
    w = w * scale
    w[..., ::7] = 0.0
    w[..., 3::11] = -0.0
    return w.to(dtype)


def ties(shape, dtype, seed):
    """Blocks of 32 whose first element is 6 * 2^s (so the MXFP4 scale is 2^s) and whose others are
    +-ties between E2M1 magnitudes, +-0, values rounding to zero and values past 6: every rounding
    edge of the encoding at that scale."""
    g = torch.Generator().manual_seed(seed)
    values = torch.tensor([*TIES, 0.0, 6.0, 7.9, 0.2, 1e-30, 0.5, 3.0])
    values = torch.cat([values, -values])
    w = values[torch.randint(0, values.numel(), shape, generator=g)]
    w[..., ::32] = 6.0
    s = torch.exp2(torch.randint(-20, 20, (*shape[:-1], 1), generator=g).float())
    return (w * s).to(dtype)


def test_compiled_path_runs_for_cpu_float_weights():
    w = torch.randn(2, 4, 64)
    assert quantize_cpu.quantize_mxfp4(w) is not None
    assert quantize_cpu.quantize_fp8_block(w.bfloat16(), (128, 128), 1) is not None
    assert quantize_cpu.block_absmax(w, 16) is not None
    assert quantize_cpu.nvfp4_encode(w, 1, torch.ones(8, 4), torch.ones(2, 1)) is not None
    assert quantize_cpu.quantize_mxfp4(w.half()) is None  # float16: the torch path
    assert quantize_cpu.quantize_mxfp4(w.transpose(1, 2)) is None  # K not contiguous


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_mxfp4_same_bytes_as_torch(shape, dtype, monkeypatch):
    for seed, w in enumerate([spread(shape, dtype, 1), ties(shape, dtype, 2), torch.zeros(shape, dtype=dtype)]):
        want, got = both(quantize_mxfp4, w, monkeypatch)
        assert torch.equal(got.scales, want.scales), seed
        assert torch.equal(got.blocks, want.blocks), seed
        assert got.k == want.k and got.segments == want.segments


def test_mxfp4_edges_are_encoded_as_specified(monkeypatch):
    """Checks that do not lean on the torch path: ties round to the even code, -0 and negatives that
    round to zero keep the sign bit, 7.9 saturates, an all-zero block gets scale byte 0."""
    w = torch.zeros(1, 2, 64)
    w[0, 0, :9] = torch.tensor([6.0, 0.25, 0.75, 2.5, 5.0, -0.0, -0.2, 7.9, -1.25])
    w[0, 1, 32] = 1e-3
    monkeypatch.setenv(VARIANT_ENV, "auto")
    q = quantize_mxfp4(w)
    codes = torch.stack([q.blocks[0, 0, 0, :5] & 15, q.blocks[0, 0, 0, :5] >> 4], -1).flatten()[:9]
    # 6 -> 7; 0.25 -> 0 (even); 0.75 -> 2 (1.0); 2.5 -> 4 (2.0); 5 -> 6 (4.0); -0 -> 8; -0.2 -> 8; 7.9 -> 7; -1.25 -> 10
    assert codes.tolist() == [7, 0, 2, 4, 6, 8, 8, 7, 10]
    assert q.scales[0].tolist() == [[127, 0], [0, 127 - 12]]  # floor(log2(1e-3)) - 2 = -12


@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp4_segments_and_strided_rows(dtype, monkeypatch):
    w = spread((4, 24, 96), dtype, 3)
    want, got = both(quantize_mxfp4, w, monkeypatch, segments=2)
    assert got.segments == 2 and torch.equal(got.blocks, want.blocks) and torch.equal(got.scales, want.scales)
    rows = w[:, ::2]  # every other row: a view with unit stride along K only
    want, got = both(quantize_mxfp4, rows, monkeypatch)
    assert torch.equal(got.blocks, want.blocks) and torch.equal(got.scales, want.scales)


@pytest.mark.parametrize("quantize", [quantize_mxfp4, quantize_fp8_block, quantize_nvfp4])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_refuses_non_finite_with_the_same_error(quantize, bad, dtype, monkeypatch):
    w = torch.randn(3, 8, 200)
    w[2, 5, 150] = bad
    w = w.to(dtype)
    for mode in ("torch", "auto"):
        monkeypatch.setenv(VARIANT_ENV, mode)
        with pytest.raises(ValueError, match="w: contains NaN or inf; quantized formats only hold finite weights"):
            quantize(w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_block_same_bytes_as_torch(shape, dtype, monkeypatch):
    for seed, w in enumerate([spread(shape, dtype, 4), spread(shape, dtype, 5, -20, 20), torch.zeros(shape, dtype=dtype)]):
        for block in [(128, 128), (16, 32), (3, 5)]:
            want, got = both(quantize_fp8_block, w, monkeypatch, block=block)
            assert torch.equal(got.scale, want.scale), (seed, block)
            assert torch.equal(got.weight.view(torch.uint8), want.weight.view(torch.uint8)), (seed, block)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_block_segments_and_e4m3_edges(dtype, monkeypatch):
    w = spread((3, 2 * 136, 160), dtype, 6, -30, 30)
    want, got = both(quantize_fp8_block, w, monkeypatch, segments=2)
    assert got.segments == 2 and torch.equal(got.scale, want.scale)
    assert torch.equal(got.weight.view(torch.uint8), want.weight.view(torch.uint8))
    # every e4m3 rounding edge: a block whose scale is 1 (amax 448) holding each e4m3 value and the
    # midpoints between neighbours (ties to even), subnormals, -0 and values rounding to zero
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([grid, mids, -mids, torch.tensor([-0.0, 2.0**-10, -(2.0**-11), 448.0])])
    w = vals[: vals.numel() // 4 * 4].reshape(4, -1).to(dtype)
    want, got = both(quantize_fp8_block, w, monkeypatch, block=(128, 1024))  # one block: scale 1
    assert torch.equal(got.scale, want.scale)
    assert torch.equal(got.weight.view(torch.uint8), want.weight.view(torch.uint8))


def test_fp8_ue8m0_scales_keep_the_torch_path(monkeypatch):
    """scale_fmt ue8m0 (torch's log2 decides the power of two) is not compiled: same result either way."""
    w = spread((2, 64, 64), torch.float32, 7, -10, 10)
    want, got = both(quantize_fp8_block, w, monkeypatch, scale_fmt="ue8m0")
    assert torch.equal(got.scale, want.scale) and torch.equal(got.weight.view(torch.uint8), want.weight.view(torch.uint8))


def same_nvfp4(want, got):
    assert torch.equal(got.weight_scale_2, want.weight_scale_2)
    assert torch.equal(got.weight_scale.view(torch.uint8), want.weight_scale.view(torch.uint8))
    assert torch.equal(got.weight, want.weight)
    assert got.k == want.k and got.segments == want.segments


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_nvfp4_same_bytes_as_torch(shape, dtype, monkeypatch):
    # per-tensor scales: magnitudes spread over rows within a tensor, whose range e4m3 block scales
    # partly cannot hold (blocks that round to zero), and ties at the scales the blocks get
    for w in [spread(shape, dtype, 8, -30, 30), spread(shape, dtype, 9, -3, 3), ties(shape, dtype, 10), torch.zeros(shape, dtype=dtype)]:
        same_nvfp4(*both(quantize_nvfp4, w, monkeypatch))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_segments_and_strided_rows(dtype, monkeypatch):
    w = spread((3, 2 * 20, 72), dtype, 11, -8, 8)
    w[1, :20] = 0.0  # an all-zero segment: weight_scale_2 1
    same_nvfp4(*both(quantize_nvfp4, w, monkeypatch, segments=2))
    same_nvfp4(*both(quantize_nvfp4, w[:, ::3], monkeypatch))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_subnormal_and_zero_block_scales(dtype, monkeypatch):
    """Block scales in e4m3's subnormal range, and ones that round to 0 (stored as 1.0, ModelOpt's rule)."""
    w = torch.zeros(1, 2, 64)
    w[0, 0, 0] = 2688.0  # weight_scale_2 1: a block scale is amax / 6
    w[0, 0, 16] = -6 * 2.0**-8  # block scale 2^-8: e4m3 subnormal, byte 2
    w[0, 0, 32:48] = torch.linspace(-6 * 2.0**-12, 6 * 2.0**-12, 16)  # block scale 2^-12 rounds to 0: 1.0
    w[0, 1, 5] = 1.5 * 2.0**-9  # block scale 2^-11, below half the smallest subnormal 2^-9: 1.0 too
    w = w.to(dtype)
    want, got = both(quantize_nvfp4, w, monkeypatch)
    same_nvfp4(want, got)
    assert got.weight_scale.view(torch.uint8)[0].tolist() == [[0x7E, 0x02, 0x38, 0x38], [0x38, 0x38, 0x38, 0x38]]
