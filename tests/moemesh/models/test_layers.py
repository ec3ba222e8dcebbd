import pytest
import torch

from kernels import hugepages
from kernels.hugepages import HUGE_PAGE
from kernels.cpu.linear_cpu import (
    MAX_ROWS, MAX_ROWS_BF16_WIDENED, bf16_dot, holds_plain, linear_cpu, linear_cpu_variant, max_rows,
)
from kernels.cpu.variant import VARIANT_ENV, available_variants, selected_variant
from kernels.prepare import prepare_dense
from moemesh.models.layers import RotaryTable, apply_rope, apply_rope_signed, linear, matmul_layout, rope_for_step


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


def test_float32_on_the_torch_path_is_held_in_out_with_one_thread_and_packed_with_two(threads, monkeypatch):
    monkeypatch.setenv(VARIANT_ENV, "torch")
    w = torch.randn(6, 4)
    threads(1)
    assert matmul_layout(w).t().is_contiguous()  # [in, out] for MKL
    threads(2)
    assert matmul_layout(w).is_mkldnn == torch.backends.mkldnn.is_available()
    assert matmul_layout(w, pack=False).t().is_contiguous()  # kept indexable


def test_float32_is_held_plain_for_the_compiled_kernels_with_one_thread(threads):
    if not available_variants():
        pytest.skip("the compiled CPU kernels do not run here")
    w = torch.randn(40, 70)
    threads(2)
    assert matmul_layout(w).is_mkldnn == torch.backends.mkldnn.is_available()
    threads(1)
    held = matmul_layout(w)
    assert held.is_contiguous() and not held.is_mkldnn
    for rows in (1, 3, 16, 17):  # up to MAX_ROWS on the compiled kernels, then torch
        x = torch.randn(rows, 70)
        assert (linear_cpu_variant(x, held) is not None) == (rows <= MAX_ROWS[torch.float32])
        torch.testing.assert_close(linear(x, held), x @ w.t(), rtol=1e-5, atol=1e-5)


def test_compiled_linear_matches_float64_on_odd_shapes():
    if not available_variants():
        pytest.skip("the compiled CPU kernels do not run here")
    for dtype in (torch.float32, torch.bfloat16):
        for m, n, k in [(1, 100, 70), (3, 64, 128), (4, 33, 160), (16, 200, 96), (0, 5, 32)]:
            x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
            got = linear_cpu(x, w)
            want = x.double() @ w.double().t()
            assert got.dtype == dtype and got.shape == (m, n)
            tol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the output's own rounding
            if m:
                assert (got.double() - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())


def test_bfloat16_is_plain_for_bfloat16_dot_products_else_packed_unless_indexable(monkeypatch):
    b = torch.randn(6, 4).bfloat16()
    assert matmul_layout(b, pack=False) is b
    variant = selected_variant()
    plain = variant is not None and bf16_dot(variant)
    assert holds_plain(torch.bfloat16, b.device) == plain
    held = matmul_layout(b)
    assert held.is_mkldnn == (torch.backends.mkldnn.is_available() and not plain)
    if plain:  # the compiled kernels take it up to MAX_ROWS rows, then torch
        assert max_rows(torch.bfloat16, variant) == MAX_ROWS[torch.bfloat16]
        for rows in (1, 16, 17):
            x = torch.randn(rows, 4).bfloat16()
            assert (linear_cpu_variant(x, held) is not None) == (rows <= MAX_ROWS[torch.bfloat16])
            torch.testing.assert_close(linear(x, held), x @ b.t(), rtol=1e-2, atol=1e-2)
    monkeypatch.setenv(VARIANT_ENV, "torch")  # no compiled kernels: torch's packed layout
    assert matmul_layout(b).is_mkldnn == torch.backends.mkldnn.is_available()


def test_bfloat16_without_bfloat16_dot_products_takes_one_row():
    if "avx2" not in available_variants():
        pytest.skip("the AVX2 kernels do not run here")
    assert not bf16_dot("avx2")
    assert max_rows(torch.bfloat16, "avx2") == MAX_ROWS_BF16_WIDENED == 1
    assert max_rows(torch.float32, "avx2") == MAX_ROWS[torch.float32]


def test_a_plain_held_matrix_of_2_mib_or_more_moves_into_huge_page_memory(threads):
    """Where the compiled kernels read a matrix plain, matmul_layout hands them a copy in 2 MiB-page
    memory (kernels.cpu.huge_pages) when it is large enough and the system has them; smaller ones stay."""
    threads(1)  # float32 is held plain with one thread where a compiled variant runs
    if selected_variant() is None:
        pytest.skip("no compiled CPU kernel variant here: matrices are not held plain")
    big, small = torch.randn(1024, HUGE_PAGE // 4096), torch.randn(64, 32)
    held_big, held_small = matmul_layout(big), matmul_layout(small)
    assert torch.equal(held_big, big) and torch.equal(held_small, small)
    assert (held_big.data_ptr() != big.data_ptr()) == (hugepages.available())
    assert held_big.data_ptr() % HUGE_PAGE == 0 or not hugepages.available()
    assert held_small.data_ptr() == small.data_ptr()
    x = torch.randn(2, big.shape[1])
    torch.testing.assert_close(linear(x, held_big).double(), x.double() @ big.double().t(), rtol=1e-4, atol=1e-4)  # float32 sums of 512


def test_a_blockwise_fp8_dense_matrix_keeps_its_bytes_in_huge_page_memory():
    """dense_dtype "fp8": the quantized matrix's bytes go into 2 MiB pages too (its scales are small)."""
    w = torch.randn(2048, 1024) * 0.02  # 2 MiB of float8 once quantized
    held = matmul_layout(w, dense_dtype="fp8")
    reference = prepare_dense(w, "fp8")
    assert torch.equal(held.weight.view(torch.uint8), reference.weight.view(torch.uint8)) and torch.equal(held.scale, reference.scale)
    if hugepages.available():
        assert held.weight.data_ptr() % HUGE_PAGE == 0
    x = torch.randn(3, 1024)
    torch.testing.assert_close(linear(x, held), linear(x, reference))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_for_step_indexes_tables_made_once_per_dtype(dtype):
    rope = RotaryTable.build(64, 10000.0, 128)
    positions = torch.tensor([0, 5, 127, 5])
    cos, sin_signed = rope_for_step(rope, positions, dtype)  # [T, 1, D]
    assert cos.shape == sin_signed.shape == (4, 1, 64) and cos.dtype == dtype
    want_cos, want_sin = rope.for_positions(positions, dtype)
    assert torch.equal(cos, want_cos)
    assert torch.equal(sin_signed, torch.cat([-want_sin[..., :32], want_sin[..., 32:]], dim=-1))
    x = torch.randn(4, 3, 64).to(dtype)
    assert torch.equal(apply_rope_signed(x, cos, sin_signed), apply_rope(x, want_cos, want_sin))
    assert rope.signed_tables(dtype)[0] is rope.signed_tables(dtype)[0]  # made once, then reused
