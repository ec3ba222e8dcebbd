"""The compiled dense linear on quantized one-matrix weights ([1, N, K], as `matmul_layout(w,
dense_dtype=...)` holds them) against x @ dequantize(w).T, and `layers.linear`'s choice of path."""
import pytest
import torch

from kernels.cpu.linear_cpu import MAX_QUANTIZED_ROWS, linear_cpu, linear_cpu_variant
from kernels.cpu.variant import VARIANT_ENV, available_variants
from kernels.formats import cat_fp8_rows, fp8_block_from_checkpoint, quantize_fp8_block, quantize_mxfp4
from moemesh.models.layers import linear

needs_kernels = pytest.mark.skipif(not available_variants(), reason="the compiled CPU kernels do not run here")

# (N, K): neither a multiple of 128 (partial edge blocks both ways), K not a multiple of 32, and the
# sparse shape's qkv
SHAPES = [(200, 300), (129, 257), (64, 70), (1536, 1024)]
ROWS = [1, 3, 16, 17, 64]


def reference(x: torch.Tensor, w) -> torch.Tensor:
    """x @ dequantize(w).T in float64 (the kernels accumulate in float32 from the same values)."""
    return x.double() @ w.dequantize(torch.float32)[0].double().t()


def assert_within_rounding(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    # float32: accumulation-order rounding; bfloat16: the output's own rounding (8 bits of mantissa)
    tol = 2e-5 if dtype == torch.float32 else 8e-3
    scale = max(1.0, want.abs().max().item())
    assert (got.double() - want).abs().max().item() <= tol * scale


@needs_kernels
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_matches_dequantized_matmul(n, k, dtype):
    torch.manual_seed(n + k)
    w = quantize_fp8_block(torch.randn(n, k) * torch.rand(n, 1) * 0.1)
    for m in ROWS:
        x = torch.randn(m, k).to(dtype)
        assert linear_cpu_variant(x, w) is not None
        got = linear_cpu(x, w)
        assert got.dtype == dtype and got.shape == (m, n)
        assert_within_rounding(got, reference(x, w), dtype)
        assert_within_rounding(linear(x, w), reference(x, w), dtype)


@needs_kernels
def test_fp8_linear_reads_row_segments_and_other_block_sizes():
    """q | k | v stored with 32x32 blocks and joined by cat_fp8_rows (segments of 32 rows), and a matrix
    with 64 x 96 blocks."""
    torch.manual_seed(3)
    parts = [quantize_fp8_block(torch.randn(r, 96), block=(32, 32)) for r in (64, 32, 32)]
    qkv = cat_fp8_rows(parts)
    assert qkv.segments == 4
    other = quantize_fp8_block(torch.randn(150, 200), block=(64, 96))
    for w, k in ((qkv, 96), (other, 200)):
        for m in (1, 5):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k).to(dtype)
                assert_within_rounding(linear_cpu(x, w), reference(x, w), dtype)


@needs_kernels
def test_other_stored_formats_run_as_one_matrix_too():
    torch.manual_seed(4)
    w = quantize_mxfp4(torch.randn(1, 96, 128))
    x = torch.randn(2, 128)
    assert_within_rounding(linear_cpu(x, w), reference(x, w), torch.float32)


@needs_kernels
def test_prefill_rows_dequantize_for_torch():
    torch.manual_seed(5)
    w = quantize_fp8_block(torch.randn(100, 80))
    x = torch.randn(MAX_QUANTIZED_ROWS + 1, 80)
    assert linear_cpu_variant(x, w) is None
    assert_within_rounding(linear(x, w), reference(x, w), torch.float32)


def test_torch_path_gives_the_same_numbers(monkeypatch):
    monkeypatch.setenv(VARIANT_ENV, "torch")
    torch.manual_seed(6)
    w = quantize_fp8_block(torch.randn(130, 72))
    for m in (1, 3):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, 72).to(dtype)
            assert linear_cpu_variant(x, w) is None
            got = linear(x, w)
            assert got.dtype == dtype and got.shape == (m, 130)
            # bfloat16: torch rounds the dequantized weight to bfloat16 too
            assert_within_rounding(got, reference(x, w), torch.float32 if dtype == torch.float32 else torch.bfloat16)


@needs_kernels
def test_plain_weights_keep_their_path_and_bad_weights_are_refused():
    torch.manual_seed(7)
    x = torch.randn(1, 64)
    w = torch.randn(40, 64)
    torch.testing.assert_close(linear_cpu(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)
    stacked = quantize_fp8_block(torch.randn(2, 40, 64))  # two experts: not one matrix
    assert linear_cpu_variant(x, stacked) is None
    with pytest.raises(ValueError, match="one matrix"):
        linear_cpu(x, stacked)
    with pytest.raises(ValueError, match="float32, bfloat16 or a quantized"):
        linear_cpu(x, w.half())
    stored = fp8_block_from_checkpoint(quantize_fp8_block(torch.randn(40, 64)).weight[0], torch.ones(1, 1))  # [N, K] as on disk
    assert_within_rounding(linear_cpu(x, stored), reference(x, stored), torch.float32)


@needs_kernels
@pytest.mark.parametrize("n,k", [(200, 300), (129, 257), (64, 70), (33, 32)])
def test_plain_bfloat16_at_every_row_count(n, k):
    # bfloat16 x and weights: up to 4 rows the float32 stream; above, with AVX512-BF16, the bfloat16
    # dot products (pairs of weight rows, an odd last one alone, against groups of up to 8 activation
    # rows; K ending inside a 32-element step), else the float32 kernels; every variant gives the
    # float64 product to the output's rounding
    torch.manual_seed(n * k)
    w = torch.randn(n, k).bfloat16()
    for m in (1, 2, 4, 5, 8, 9, 16, 17, 24):
        x = torch.randn(m, k).bfloat16()
        want = x.double() @ w.double().t()
        for variant in available_variants():
            got = linear_cpu(x, w, variant)
            assert got.dtype == torch.bfloat16 and got.shape == (m, n)
            assert_within_rounding(got, want, torch.bfloat16)
