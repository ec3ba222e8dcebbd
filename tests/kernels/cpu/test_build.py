"""kernels.cpu.build: the library runs its parallel regions on torch's intra-op threads, and the results
do not depend on how many there are."""
import pytest
import torch

from kernels import ExpertWeights, moe_mlp, prepare_experts
from kernels.cpu.build import extension
from kernels.cpu.linear_cpu import linear_cpu
from kernels.cpu.variant import available_variants
from kernels.formats import quantize_mxfp4

needs_kernels = pytest.mark.skipif(not available_variants(), reason="the compiled CPU kernels do not run here")


@pytest.fixture
def threads():
    """Sets torch's intra-op thread count for the test, then puts the old one back."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@needs_kernels
def test_parallel_regions_use_torchs_threads(threads):
    # without OpenMP at compile time ATen's parallel_for runs every region on the calling thread
    threads(2)
    assert extension().parallel_threads(64) == 2
    threads(1)
    assert extension().parallel_threads(64) == 1


@needs_kernels
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4", "fp8"])
def test_results_do_not_depend_on_the_thread_count(threads, fmt):
    # every output element is summed by one thread in a fixed order: bit for bit the same
    g = torch.Generator().manual_seed(0)
    dense = ExpertWeights(torch.randn(8, 2 * 96, 256, generator=g) * 0.1, torch.randn(8, 256, 96, generator=g) * 0.1,
                          None, None, "silu")
    w = prepare_experts(dense, fmt, torch.bfloat16)
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    token_idx = torch.tensor([0, 1, 2, 3, 4, 0, 2, 4, 1, 3])
    row_weight = torch.rand(10, generator=g)
    expert_idx, counts = torch.tensor([1, 3, 6, 7]), torch.tensor([3, 2, 4, 1])
    lin = quantize_mxfp4((torch.randn(1, 384, 256, generator=g) * 0.1))
    plain = (torch.randn(203, 256, generator=g) * 0.1).bfloat16()  # odd rows: pairs and one alone
    x9 = torch.randn(9, 256, generator=g).bfloat16()  # two groups of activation rows
    out = {}
    for n in (1, 2):
        threads(n)
        out[n] = (moe_mlp(x, token_idx, row_weight, expert_idx, counts, w, backend="cpu"), linear_cpu(x, lin),
                  linear_cpu(x9, plain))
    for a, b in zip(out[1], out[2]):
        assert torch.equal(a, b)


@needs_kernels
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_whole_experts_per_thread_sum_as_the_column_split(threads, fmt, dtype, bias):
    # one token's top-4 (one row per expert): on 2 and 4 threads each thread runs whole experts, on 1
    # and 3 the columns are split; two tokens that chose the same experts: the columns are split on
    # every count. The same sums either way, bit for bit (float32 results show the order of the
    # experts' additions)
    g = torch.Generator().manual_seed(1)
    b = (lambda *s: torch.randn(*s, generator=g) * 0.1) if bias else (lambda *s: None)
    dense = ExpertWeights(torch.randn(8, 2 * 96, 256, generator=g) * 0.1, torch.randn(8, 256, 96, generator=g) * 0.1,
                          b(8, 2 * 96), b(8, 256), "silu")
    w = prepare_experts(dense, fmt, dtype)
    cases = []
    for rows in (1, 2):  # one token's top-4, and two tokens that chose the same four experts
        x = torch.randn(rows, 256, generator=g).to(dtype)
        token_idx = torch.arange(rows).repeat(4)
        cases.append((x, token_idx, torch.rand(4 * rows, generator=g), torch.tensor([0, 2, 5, 7]),
                      torch.full((4,), rows)))
    out = {}
    for n in (1, 2, 3, 4):
        threads(n)
        out[n] = [moe_mlp(*c, w, backend="cpu") for c in cases]
    for n in (2, 3, 4):
        for a, b_ in zip(out[1], out[n]):
            assert torch.equal(a, b_)
