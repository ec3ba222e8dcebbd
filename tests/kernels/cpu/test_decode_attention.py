"""The compiled decode attention (kernels.cpu.step_ops.decode_attention) at long contexts, on both
instruction-set variants and the plain C++ loops, against a float64 reference that rounds where the
kernel rounds: float32 scores, exp(score - max) in float32, rounded to bfloat16 before it weights V for
bfloat16, divided by the float32 sum of the unrounded values.

Shape legend: B sequences, NH query heads, KVH key/value heads, G = NH/KVH, D head dim, BS block
size, NB blocks per sequence, NBLK cache blocks, S = NB*BS positions.
"""
import math

import pytest
import torch

from kernels.cpu import step_ops
from kernels.cpu.build import extension
from kernels.cpu.variant import VARIANT_ENV, available_variants

BS = 16


@pytest.fixture(autouse=True)
def compiled_or_skip():
    if not available_variants():
        pytest.skip("the compiled CPU kernels do not run here")


def paged_case(lengths, nh, kvh, d, dtype, holes=False, seed=0):
    """Sequences of `lengths` cached positions (the last one this step's) in shuffled blocks of a paged
    cache; holes: about a third of the earlier positions masked out. Returns q [B, NH, D], k / v [B, KVH, D]
    (strided views, as the qkv projection lays them out), k_cache / v_cache [NBLK, BS, KVH, D],
    slots [B], tables [B, NB], mask [B, S]."""
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    nb = max(1, max(math.ceil(n / BS) for n in lengths))
    nblk = b * nb + 3
    tables = torch.randperm(nblk, generator=g)[: b * nb].view(b, nb)  # non-contiguous, out of order
    pos = torch.arange(nb * BS)
    lens = torch.tensor(lengths)
    mask = pos[None] < lens[:, None]  # [B, S]
    if holes:
        mask &= (torch.rand(b, nb * BS, generator=g) > 0.3) | (pos[None] == lens[:, None] - 1)
    last = (lens - 1).clamp(min=0)
    slots = tables[torch.arange(b), last // BS] * BS + last % BS
    heads = torch.randn(b, nh + 2 * kvh, d, generator=g).to(dtype)
    q, k, v = heads[:, :nh], heads[:, nh : nh + kvh], heads[:, nh + kvh :]
    caches = [torch.randn(nblk, BS, kvh, d, generator=g).to(dtype) for _ in range(2)]
    return q, k, v, caches[0], caches[1], slots, tables, mask


def reference(q, k_cache, v_cache, tables, mask, round_p):
    """[B, NH, D] float64 (the caches already hold this step's rows), rounding as the kernel rounds."""
    b, nh, d = q.shape
    kvh = k_cache.shape[2]
    out = torch.zeros(b, nh, d, dtype=torch.float64)
    scale = torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32)
    for i in range(b):
        rows = (tables[i][:, None] * BS + torch.arange(BS)).flatten()[mask[i]]  # [n] cache rows
        if rows.numel() == 0:
            continue
        kk = k_cache.reshape(-1, kvh, d)[rows].double()  # [n, KVH, D]
        vv = v_cache.reshape(-1, kvh, d)[rows].double()
        qq = q[i].double().view(kvh, nh // kvh, d)  # [KVH, G, D]
        s = torch.einsum("hgd,nhd->hgn", qq, kk).float() * scale  # float32 scores [KVH, G, n]
        e = torch.exp(s - s.amax(-1, keepdim=True))
        p = e.bfloat16().double() if round_p else e.double()
        out[i] = (torch.einsum("hgn,nhd->hgd", p, vv) / e.double().sum(-1, keepdim=True)).reshape(nh, d)
    return out


def bound_bf16(q, v_cache, tables, mask, want):
    """Per element: half a bfloat16 step of the result (its rounding) plus what a last-bit difference of the
    rounded probabilities can move it by (2^-8 of sum_j p_j |v_j| / sum_j p_j, bounded by max |v|)."""
    b, nh, d = q.shape
    kvh = v_cache.shape[2]
    spread = torch.zeros_like(want)
    for i in range(b):
        rows = (tables[i][:, None] * BS + torch.arange(BS)).flatten()[mask[i]]
        if rows.numel():
            vmax = v_cache.reshape(-1, kvh, d)[rows].double().abs().amax(0)  # [KVH, D]
            spread[i] = vmax.repeat_interleave(nh // kvh, 0)
    step = torch.exp2(torch.floor(torch.log2(want.abs().clamp(min=1e-30))) - 7)
    return 0.5 * step + 2.0**-8 * spread + 1e-7


def check(got, q, v_cache, tables, mask, want):
    assert got.shape == q.shape and got.dtype == q.dtype
    if q.dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    else:
        assert ((got.double() - want).abs() <= bound_bf16(q, v_cache, tables, mask, want)).all()
        # mostly the very same bits: a probability whose rounding flips (exp or a float32 sum off by its
        # last bit) moves a few results of its head over a rounding boundary
        assert (got != want.bfloat16()).sum().item() <= 0.03 * want.numel()


def run(case, variant=None):
    """step_ops.decode_attention on `case` (copies of its caches): (out, k_cache, v_cache); variant "plain"
    calls the extension's plain loops directly."""
    q, k, v, kc, vc, slots, tables, mask = case
    kc, vc = kc.clone(), vc.clone()
    if variant == "plain":
        out = extension().decode_attention(q, k, v, kc, vc, slots, tables, mask, "plain")
    else:
        out = step_ops.decode_attention(q, k, v, kc, vc, slots, tables, mask)
    assert out is not None
    return out, kc, vc


def variants():
    return [v for v in ("avx512", "avx2") if v in available_variants()] + ["plain"]


LENGTHS = {
    "1": [1], "15": [15], "16": [16], "17": [17], "200": [200], "1100": [1100],
    "16 mixed": [1, 15, 16, 17, 33, 64, 100, 200, 257, 512, 700, 1000, 1100, 31, 2, 129],
}


@pytest.mark.parametrize("variant", variants())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=str)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("d", [64, 128])
def test_decode_attention_long_contexts(monkeypatch, variant, dtype, lengths, group, d):
    if variant != "plain":
        monkeypatch.setenv(VARIANT_ENV, variant)
    kvh = 2 if group < 8 else 1
    case = paged_case(LENGTHS[lengths], group * kvh, kvh, d, dtype, seed=len(lengths) + group + d)
    q, k, v, kc, vc, slots, tables, mask = case
    got, gkc, gvc = run(case, variant)
    # this step's rows written first, nothing else touched
    kc.view(-1, kvh, d)[slots] = k
    vc.view(-1, kvh, d)[slots] = v
    assert torch.equal(gkc, kc) and torch.equal(gvc, vc)
    check(got, q, vc, tables, mask, reference(q, kc, vc, tables, mask, dtype == torch.bfloat16))


@pytest.mark.parametrize("variant", variants())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch", [1, 16])
def test_decode_attention_masked_positions_and_runs_across_blocks(monkeypatch, variant, dtype, batch):
    if variant != "plain":
        monkeypatch.setenv(VARIANT_ENV, variant)
    lengths = [1000 + 37 * i for i in range(batch)]
    case = paged_case(lengths, 8, 2, 64, dtype, holes=True, seed=batch)
    q, k, v, kc, vc, slots, tables, mask = case
    got, _, _ = run(case, variant)
    kc.view(-1, 2, 64)[slots] = k
    vc.view(-1, 2, 64)[slots] = v
    check(got, q, vc, tables, mask, reference(q, kc, vc, tables, mask, dtype == torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [24, 8])
def test_head_dims_the_variants_do_not_take_run_the_plain_loops(dtype, d):
    case = paged_case([300, 5], 4, 2, d, dtype, holes=True, seed=d)
    q, k, v, kc, vc, slots, tables, mask = case
    got, _, _ = run(case)
    plain, _, _ = run(case, "plain")
    assert torch.equal(got, plain)
    kc.view(-1, 2, d)[slots] = k
    vc.view(-1, 2, d)[slots] = v
    check(got, q, vc, tables, mask, reference(q, kc, vc, tables, mask, dtype == torch.bfloat16))


@pytest.mark.parametrize("variant", variants())
def test_a_sequence_with_nothing_to_attend_gets_zeros(variant):
    case = paged_case([40, 3], 4, 2, 64, torch.float32, seed=1)
    q, k, v, kc, vc, slots, tables, mask = case
    mask = mask.clone()
    mask[1] = False
    out = extension().decode_attention(q, k, v, kc.clone(), vc.clone(), slots, tables, mask, variant)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert out[0].abs().sum() > 0


def test_an_unknown_variant_is_refused():
    q, k, v, kc, vc, slots, tables, mask = paged_case([5], 4, 2, 64, torch.float32)
    with pytest.raises(RuntimeError, match="variant"):
        extension().decode_attention(q, k, v, kc, vc, slots, tables, mask, "avx1024")
