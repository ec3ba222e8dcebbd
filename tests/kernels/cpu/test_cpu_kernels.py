"""The compiled CPU kernels (kernels.cpu) against the reference path (dequantize, then torch matmuls),
for every weight format, both compute dtypes and every variant this machine runs."""
import warnings

import pytest
import torch

from kernels import ExpertWeights, grouped_expert_mlp, moe_mlp, prepare_experts
from kernels.cpu import build
from kernels.cpu.moe_mlp_cpu import MAX_ROWS_PER_EXPERT, compiled_runs, moe_mlp_cpu, unsupported
from kernels.cpu.variant import VARIANT_ENV, available_variants, selected_variant
from kernels.experts import apply_activation, dequantized
from kernels.formats import fp8_block_from_checkpoint, quantize_fp8_block

FORMATS = ["f32", "bf16", "fp8", "mxfp4", "nvfp4"]
VARIANTS = ["avx512", "avx2"]


def variant_or_skip(variant: str) -> str:
    if variant not in available_variants():
        pytest.skip(f"the {variant} kernels do not run here (available: {available_variants()})")
    return variant


def weights(fmt, dtype, h, i, activation="silu", bias=False, e=6, seed=0):
    """Experts in `fmt` for compute in `dtype`: "f32" keeps float32 weights, "bf16" stores bfloat16."""
    g = torch.Generator().manual_seed(seed)
    dense = ExpertWeights(
        torch.randn(e, 2 * i, h, generator=g) * 0.2,
        torch.randn(e, h, i, generator=g) * 0.2,
        torch.randn(e, 2 * i, generator=g) * 0.1 if bias else None,
        torch.randn(e, h, generator=g) * 0.1 if bias else None,
        activation,
    )
    if fmt == "f32":
        return dense
    w = prepare_experts(dense, fmt, dtype)
    if fmt == "bf16":
        w = ExpertWeights(w.gate_up.to(torch.bfloat16), w.down.to(torch.bfloat16), w.gate_up_bias, w.down_bias, activation)
    return w


def routing(t, counts, seed=0):
    """token_idx [N] (tokens repeat across experts), row_weight [N] for rows grouped as `counts`."""
    g = torch.Generator().manual_seed(seed)
    n = int(sum(counts))
    return torch.randint(0, t, (n,), generator=g), torch.rand(n, generator=g)


def oracle(x, token_idx, row_weight, expert_idx, counts, w):
    """float64 on exactly the dequantized float32 weights."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    start = 0
    for e, n in zip(expert_idx.tolist(), counts.tolist()):
        rows = x[token_idx[start : start + n]].double()
        gu = dequantized(w.gate_up, torch.float32, torch.tensor([e]))[0].double()
        dn = dequantized(w.down, torch.float32, torch.tensor([e]))[0].double()
        h = rows @ gu.T + (w.gate_up_bias[e].double() if w.gate_up_bias is not None else 0)
        y = apply_activation(h, w.activation) @ dn.T + (w.down_bias[e].double() if w.down_bias is not None else 0)
        out.index_add_(0, token_idx[start : start + n], y * row_weight[start : start + n, None].double())
        start += n
    return out


def check_close(got, x, token_idx, row_weight, expert_idx, counts, w):
    """float32: within 1e-5 of the largest output of the reference path. bfloat16: no further from the
    float64 oracle than twice the reference path's own bfloat16 error (which rounds more often)."""
    assert got.dtype == x.dtype and got.shape == x.shape
    ref = moe_mlp(x, token_idx, row_weight, expert_idx, counts, w, backend="torch")
    scale = ref.float().abs().max().item()
    if x.dtype == torch.float32:
        err = (got - ref).abs().max().item()
        assert err <= 1e-5 * scale, f"max error {err} vs output scale {scale}"
        return
    truth = oracle(x.float(), token_idx, row_weight, expert_idx, counts, w)
    err = (got.double() - truth).abs().max().item()
    ref_err = (ref.double() - truth).abs().max().item()
    assert err <= max(2 * ref_err, 1e-3 * scale), f"bfloat16 error {err}, reference path's {ref_err}"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["x_f32", "x_bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "h, i, activation, bias",
    [(64, 48, "silu", False), (160, 136, "swiglu_oai", True), (100, 70, "silu", True)],
    ids=["aligned", "edge_blocks", "odd"],
)
def test_matches_the_reference_path(variant, dtype, fmt, h, i, activation, bias):
    variant_or_skip(variant)
    w = weights(fmt, dtype, h, i, activation, bias)
    expert_idx = torch.tensor([4, 0, 2, 5, 1])  # unsorted, expert 3 absent
    counts = torch.tensor([3, 0, 1, 9, 2])  # a 0-row and a 1-row expert; 9 rows run the buffered tiles
    x = torch.randn(7, h, generator=torch.Generator().manual_seed(h)).to(dtype)
    token_idx, row_weight = routing(7, counts.tolist())
    got = moe_mlp_cpu(x, token_idx, row_weight, expert_idx, counts, w, variant)
    check_close(got, x, token_idx, row_weight, expert_idx, counts, w)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["x_f32", "x_bf16"])
@pytest.mark.parametrize("fmt", ["f32", "bf16"])
@pytest.mark.parametrize("h, i", [(128, 64), (160, 96), (100, 70)], ids=["even_chunks", "odd_chunks", "partial_chunk"])
def test_dense_experts_at_every_row_count_path(variant, dtype, fmt, h, i):
    """Dense weights at 0 to 5, 8, 9, 16, 17 and 25 rows per expert, an even or odd number of
    32-element chunks or a partial last chunk. Up to a register tile of rows (4 on AVX-512, 3 on
    AVX2) the kernels stream each weight row once. Above it, bfloat16 weights against bfloat16 x with
    AVX512-BF16 run the bfloat16 dot products (pairs of weight rows, an odd last row alone, against
    groups of up to 8 activation rows); otherwise bfloat16 up to 16 rows streams blocks of rows once
    per tile of activation rows, the rest runs the tiled paths."""
    variant_or_skip(variant)
    w = weights(fmt, dtype, h, i, e=11, seed=1)
    expert_idx = torch.tensor([7, 0, 3, 5, 1, 6, 2, 4, 10, 8, 9])
    counts = torch.tensor([1, 0, 2, 3, 4, 5, 16, 17, 8, 9, 25])
    x = torch.randn(32, h, generator=torch.Generator().manual_seed(h + i)).to(dtype)
    token_idx, row_weight = routing(32, counts.tolist(), seed=1)
    got = moe_mlp_cpu(x, token_idx, row_weight, expert_idx, counts, w, variant)
    check_close(got, x, token_idx, row_weight, expert_idx, counts, w)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize(
    "h, i", [(48, 80), (96, 112), (128, 40), (144, 70), (64, 264)],
    ids=["k48_80", "k96_112", "k128_40", "k144_70", "k64_264"],
)
def test_4bit_decode_rows_with_every_last_step(variant, fmt, h, i):
    # 1 to 9 rows per expert (with bfloat16 x and AVX512-BF16, the 16-bit integer dot products in
    # 128-element steps over tiles of 8 or 4 weight rows, 4 activation rows at a time: 6 and 9 rows
    # read a tile again for a partial group), K ending every multiple of 16 elements into a step
    # (NVFP4 pads K to 16, MXFP4 to 32), 70 output columns leaving a partial tile of rows
    variant_or_skip(variant)
    w = weights(fmt, torch.bfloat16, h, i, "silu", bias=True, e=5, seed=3)
    expert_idx, counts = torch.tensor([3, 0, 4, 1, 2]), torch.tensor([4, 1, 2, 9, 6])
    x = torch.randn(12, h, generator=torch.Generator().manual_seed(h + i)).to(torch.bfloat16)
    token_idx, row_weight = routing(12, counts.tolist(), seed=1)
    got = moe_mlp_cpu(x, token_idx, row_weight, expert_idx, counts, w, variant)
    check_close(got, x, token_idx, row_weight, expert_idx, counts, w)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_4bit_bfloat16_activations_of_wide_range_and_non_finite(variant, fmt):
    # With AVX512-BF16 the 4-bit tiles hold each 128-element step of an activation row as 16-bit
    # integers under one power-of-two scale: elements 2^-40 to 2^10 in the same steps (exact down to
    # 2^-7 of the step's largest, rounded at 2^-15 of it below), a row of zeros, a row of
    # subnormal-sized values, and a row holding inf, which the reference path turns into non-finite
    # outputs for its token only.
    variant_or_skip(variant)
    h, i = 256, 136
    w = weights(fmt, torch.bfloat16, h, i, "silu", e=4, seed=5)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, h, generator=g) * torch.exp2(torch.randint(-40, 11, (6, h), generator=g).float())
    x[2] = 0
    x[3] = torch.randn(h, generator=g) * 2.0**-125
    x = x.to(torch.bfloat16)
    expert_idx, counts = torch.tensor([2, 0, 3]), torch.tensor([6, 1, 4])
    token_idx = torch.tensor([0, 1, 2, 3, 4, 5, 1, 0, 4, 5, 2])
    row_weight = torch.rand(11, generator=g)
    got = moe_mlp_cpu(x, token_idx, row_weight, expert_idx, counts, w, variant)
    check_close(got, x, token_idx, row_weight, expert_idx, counts, w)
    assert (got[2] == 0).all()
    x[4, 130] = float("inf")
    with_inf = moe_mlp_cpu(x, token_idx, row_weight, expert_idx, counts, w, variant)
    ref = moe_mlp(x, token_idx, row_weight, expert_idx, counts, w, backend="torch")
    assert not torch.isfinite(ref[4]).any() and not torch.isfinite(with_inf[4]).any()
    others = [0, 1, 2, 3, 5]  # each activation row is scaled on its own: the others are unchanged
    assert torch.equal(with_inf[others], got[others])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("block", [(32, 32), (16, 64), (128, 128)], ids=["b32", "b64", "b128"])
@pytest.mark.parametrize("h, i", [(96, 70), (200, 136)], ids=["k96_70", "k200_136"])
def test_fp8_decode_rows_with_every_block_width(variant, block, h, i):
    # 1 to 9 rows per expert (with bfloat16 x and AVX512-BF16, the bfloat16 dot products summing a
    # block's 32-element chunks before its scale, 4 activation rows at a time; blocks of 64 or more
    # elements decoded with byte permutes where the CPU has AVX512-VBMI, 32-element blocks with word
    # permutes), blocks of 1, 2 or 4 chunks, K ending inside a chunk and inside a block, 70 output
    # columns leaving a partial tile of rows
    variant_or_skip(variant)
    g = torch.Generator().manual_seed(h + block[1])
    w = ExpertWeights(
        quantize_fp8_block(torch.randn(5, 2 * i, h, generator=g) * 0.2, block, segments=2),
        quantize_fp8_block(torch.randn(5, h, i, generator=g) * 0.2, block),
    )
    expert_idx, counts = torch.tensor([3, 0, 4, 1, 2]), torch.tensor([4, 1, 2, 9, 6])
    x = torch.randn(12, h, generator=g).to(torch.bfloat16)
    token_idx, row_weight = routing(12, counts.tolist(), seed=2)
    got = moe_mlp_cpu(x, token_idx, row_weight, expert_idx, counts, w, variant)
    check_close(got, x, token_idx, row_weight, expert_idx, counts, w)


def test_every_e4m3_code_decodes_alike_in_every_variant():
    # one-hot bfloat16 tokens pick single gate/up weights over every e4m3 code (subnormals included),
    # and one-hot down rows pick single activations: no sums, so every variant (each with its own
    # e4m3 decode, the same activation code) gives the same bits
    found = available_variants()
    if len(found) < 2:
        pytest.skip(f"needs two compiled variants (here: {found})")
    e, h, i = 2, 64, 128
    n, c = torch.meshgrid(torch.arange(2 * i), torch.arange(h), indexing="ij")
    codes = torch.stack([(n * 7 + c * 13 + x) % 256 for x in range(e)]).to(torch.uint8)  # [E, 2I, H]
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
    down = torch.zeros(e, h, i, dtype=torch.uint8)
    down[:, torch.arange(h), (torch.arange(h) * 3) % i] = 0x38  # 1.0
    ones = lambda t: torch.ones(e, -(-t.shape[1] // 128), -(-t.shape[2] // 128))  # noqa: E731
    w = ExpertWeights(
        fp8_block_from_checkpoint(codes.view(torch.float8_e4m3fn), ones(codes)),
        fp8_block_from_checkpoint(down.view(torch.float8_e4m3fn), ones(down)),
    )
    x = torch.zeros(4, h, dtype=torch.bfloat16)
    x[torch.arange(4), torch.tensor([0, 5, 17, 63])] = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.bfloat16)
    expert_idx, counts = torch.tensor([1, 0]), torch.tensor([4, 3])
    token_idx, row_weight = torch.tensor([0, 1, 2, 3, 3, 0, 2]), torch.ones(7)
    outs = [moe_mlp_cpu(x, token_idx, row_weight, expert_idx, counts, w, variant) for variant in found]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    check_close(outs[0], x, token_idx, row_weight, expert_idx, counts, w)


@pytest.mark.parametrize("variant", VARIANTS)
def test_single_token_decode_and_untouched_tokens(variant):
    variant_or_skip(variant)
    w = weights("mxfp4", torch.float32, 96, 64, e=8)
    x = torch.randn(3, 96)
    expert_idx, counts = torch.tensor([1, 6]), torch.tensor([1, 1])
    token_idx, row_weight = torch.tensor([2, 2]), torch.tensor([0.25, 0.75])
    got = moe_mlp_cpu(x, token_idx, row_weight, expert_idx, counts, w, variant)
    assert torch.equal(got[:2], torch.zeros(2, 96))  # tokens without a row get zeros
    check_close(got, x, token_idx, row_weight, expert_idx, counts, w)


def test_no_rows_gives_zeros():
    variant_or_skip(VARIANTS[1])
    w = weights("nvfp4", torch.float32, 64, 32)
    x = torch.randn(4, 64)
    out = moe_mlp_cpu(x, torch.zeros(0, dtype=torch.long), torch.zeros(0), torch.tensor([2]), torch.tensor([0]), w, "avx2")
    assert torch.equal(out, torch.zeros(4, 64))


def test_variants_agree_and_env_selects_them(monkeypatch):
    found = available_variants()
    if not found:
        pytest.skip("no compiled variant here")
    w = weights("fp8", torch.float32, 160, 136, "swiglu_oai", bias=True)
    x = torch.randn(5, 160)
    expert_idx, counts = torch.tensor([0, 3]), torch.tensor([4, 3])
    token_idx, row_weight = routing(5, counts.tolist())
    outs = {}
    for variant in found:
        monkeypatch.setenv(VARIANT_ENV, variant)
        assert selected_variant() == variant
        outs[variant] = moe_mlp(x, token_idx, row_weight, expert_idx, counts, w)
    scale = outs[found[0]].abs().max().item()
    for out in outs.values():  # same numbers up to float32 summation order
        torch.testing.assert_close(out, outs[found[0]], rtol=0, atol=1e-5 * scale)
    monkeypatch.setenv(VARIANT_ENV, "torch")  # the torch path, as where no variant exists
    assert selected_variant() is None and not compiled_runs(x, counts, w)
    ref = moe_mlp(x, token_idx, row_weight, expert_idx, counts, w, backend="torch")
    assert torch.equal(moe_mlp(x, token_idx, row_weight, expert_idx, counts, w), ref)
    monkeypatch.setenv(VARIANT_ENV, "sse9")
    with pytest.raises(ValueError, match=VARIANT_ENV):
        selected_variant()


def test_grouped_expert_mlp_on_the_compiled_kernels():
    if not available_variants():
        pytest.skip("no compiled variant here")
    w = weights("bf16", torch.bfloat16, 64, 48, "swiglu_oai", bias=True)
    x = torch.randn(6, 64).to(torch.bfloat16)
    expert_idx, counts = torch.tensor([3, 1]), torch.tensor([2, 4])
    got = grouped_expert_mlp(x, expert_idx, counts, w, backend="cpu")  # [N, H]: each row unweighted
    ref = grouped_expert_mlp(x, expert_idx, counts, w, backend="torch")
    truth = oracle(x.float(), torch.arange(6), torch.ones(6), expert_idx, counts, w)
    err, ref_err = ((t.double() - truth).abs().max().item() for t in (got, ref))
    assert got.dtype == torch.bfloat16 and err <= max(2 * ref_err, 1e-3 * truth.abs().max().item())


def test_auto_falls_back_to_torch_where_the_kernels_do_not_run():
    w = weights("f32", torch.float32, 64, 32)
    x = torch.randn(MAX_ROWS_PER_EXPERT + 1, 64)
    counts = torch.tensor([MAX_ROWS_PER_EXPERT + 1])
    assert not compiled_runs(x, counts, w)  # a prefill-sized group
    assert not compiled_runs(x.half(), torch.tensor([1]), w)  # float16 compute
    narrow = ExpertWeights(quantize_fp8_block(w.gate_up, block=(16, 16), segments=2), quantize_fp8_block(w.down, block=(16, 16)))
    assert not compiled_runs(x, torch.tensor([1]), narrow)  # FP8 blocks narrower than a 32-wide chunk
    with pytest.raises(ValueError, match="gate_up"):
        moe_mlp_cpu(x[:1], torch.tensor([0]), torch.ones(1), torch.tensor([0]), torch.tensor([1]), narrow)
    token_idx = torch.zeros(1, dtype=torch.long)
    got = moe_mlp(x[:1], token_idx, torch.ones(1), torch.tensor([0]), torch.tensor([1]), narrow)
    ref = moe_mlp(x[:1], token_idx, torch.ones(1), torch.tensor([0]), torch.tensor([1]), narrow, backend="torch")
    assert torch.equal(got, ref)


def test_bad_indices_raise_value_error():
    if not available_variants():
        pytest.skip("no compiled variant here")
    w = weights("bf16", torch.float32, 64, 32)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="expert_idx"):
        moe_mlp_cpu(x, torch.tensor([0]), torch.ones(1), torch.tensor([6]), torch.tensor([1]), w)
    with pytest.raises(ValueError, match="token_idx"):
        moe_mlp_cpu(x, torch.tensor([2]), torch.ones(1), torch.tensor([0]), torch.tensor([1]), w)
    with pytest.raises(ValueError, match="counts"):
        moe_mlp_cpu(x, torch.tensor([0]), torch.ones(1), torch.tensor([0]), torch.tensor([2]), w)


def test_a_failed_build_warns_and_leaves_the_torch_path(monkeypatch, tmp_path):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert build.extension.__wrapped__() is None
    assert any("torch path" in str(c.message) for c in caught)


def test_kernel_view_is_built_once_and_again_when_a_projection_is_replaced():
    variant = variant_or_skip(available_variants()[0] if available_variants() else "avx2")
    w = weights("mxfp4", torch.bfloat16, 128, 64, e=4)
    x = torch.randn(2, 128).to(torch.bfloat16)
    token_idx, row_weight = torch.tensor([0, 1, 1]), torch.tensor([1.0, 0.5, 0.5])
    expert_idx, counts = torch.tensor([0, 3]), torch.tensor([1, 2])
    first = moe_mlp_cpu(x, token_idx, row_weight, expert_idx, counts, w, variant)
    view = w.kernel_view
    assert view is not None and moe_mlp_cpu(x, token_idx, row_weight, expert_idx, counts, w, variant).equal(first)
    assert w.kernel_view is view  # the second call reused it
    other = weights("nvfp4", torch.bfloat16, 128, 64, e=4, seed=1)
    w.gate_up, w.down = other.gate_up, other.down  # replaced in place: the view follows
    got = moe_mlp_cpu(x, token_idx, row_weight, expert_idx, counts, w, variant)
    assert w.kernel_view is not view
    check_close(got, x, token_idx, row_weight, expert_idx, counts, w)
    w.down = torch.randn(4, 128, 64).half()  # a dtype the kernels do not read: the view says so, naming it
    assert "down" in (unsupported(x, w) or "")
