"""The decode step's compiled small ops (kernels.cpu.step_ops) against the torch code they replace:
RMSNorm, residual add + RMSNorm, per-head q/k RMSNorm + rope, decode attention over the paged KV
cache, softmax top-k routing plan, the sampler's argmax and logsumexp."""
import pytest
import torch
import torch.nn.functional as F

from kernels import ExpertWeights
from kernels.cpu import step_ops
from kernels.cpu.variant import VARIANT_ENV, available_variants
from moemesh.models.attention import paged_attention
from moemesh.models.batch import BatchMeta, SeqSlice
from moemesh.models.layers import add_rms_norm, apply_rope_signed, norm_rope, rms_norm
from moemesh.moe.dispatch import make_plan, route
from moemesh.moe.gate import softmax_topk

DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(autouse=True)
def compiled_or_skip():
    if not available_variants():
        pytest.skip("the compiled CPU kernels do not run here")


def torch_rms_norm(x, weight, eps):
    """moemesh.models.layers.rms_norm's torch path."""
    if x.dtype == torch.float32 and weight.dim() == 1:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x, (x.shape[-1],), None, eps) * weight


def close(got, want):
    """Equal in bfloat16 (same rounding points; a float32 sum in another order may flip a last bit),
    float32 to rounding."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.bfloat16:
        assert (got != want).sum().item() <= 1e-3 * want.numel()
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1024,), (1, 1024), (16, 1024), (3, 100), (0, 64), (2, 5, 64)])
def test_rms_norm_matches_torch(dtype, shape):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    got = step_ops.rms_norm(x, w, 1e-6)
    assert got is not None
    close(got, torch_rms_norm(x, w, 1e-6))
    close(rms_norm(x, w, 1e-6), torch_rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_norm_on_a_strided_view_matches_torch(dtype):
    heads = torch.randn(4, 24, 64).to(dtype)  # [T, NH+2KVH, D]
    qk = heads[:, :20]  # [T, NH+KVH, D], not contiguous
    w = torch.randn(20, 64).to(dtype)  # one weight row per head
    got = step_ops.rms_norm(qk, w, 1e-6)
    assert got is not None and got.is_contiguous()
    close(got, torch_rms_norm(qk, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 16])
def test_add_rms_norm_returns_the_sum_and_its_norm(dtype, rows):
    x, r = torch.randn(rows, 1024).to(dtype), torch.randn(rows, 1024).to(dtype)
    w = torch.randn(1024).to(dtype)
    s, h = add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(s, x + r)
    close(h, torch_rms_norm(x + r, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5])
def test_qk_norm_rope_matches_norm_then_rope(dtype, tokens):
    g = torch.Generator().manual_seed(2)
    heads = torch.randn(tokens, 24, 64, generator=g).to(dtype)
    qk = heads[:, :20]
    w = torch.randn(20, 64, generator=g).to(dtype)
    cos, sin = (torch.randn(tokens, 1, 64, generator=g).to(dtype) for _ in range(2))  # as rope_for_step gives them
    want = apply_rope_signed(torch_rms_norm(qk, w, 1e-6), cos, sin)
    got = step_ops.qk_norm_rope(qk, w, 1e-6, cos, sin)
    assert got is not None
    close(got, want)
    close(norm_rope(qk, w, 1e-6, cos, sin), want)
    torch.testing.assert_close(norm_rope(qk, None, 1e-6, cos, sin), apply_rope_signed(qk, cos, sin))  # no norm: rope only


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 64, 8), (16, 64, 8), (7, 10, 1), (3, 5, 4), (2, 128, 8), (3, 640, 8)])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("ties", [False, True])
def test_route_topk_gives_make_plans_dropless_plan(dtype, tokens, experts, top_k, normalize, ties):
    g = torch.Generator().manual_seed(tokens * experts)
    # ties: few distinct logits, so that equal probabilities straddle the top-k cut (torch.topk's choice kept)
    logits = (torch.randint(0, 4, (tokens, experts), generator=g).float() if ties else torch.randn(tokens, experts, generator=g)).to(dtype)
    want = make_plan(softmax_topk(logits, top_k, normalize), experts)
    token_idx, weights, expert_ids, counts = step_ops.route_topk(logits, top_k, normalize)
    assert torch.equal(token_idx, want.token_idx) and torch.equal(expert_ids, want.expert_ids)
    assert torch.equal(counts, want.counts)
    torch.testing.assert_close(weights, want.weights, rtol=1e-6, atol=1e-7)
    got = route(logits, top_k, normalize, experts)
    assert got.capacity is None and got.dropped == 0 and torch.equal(got.token_idx, want.token_idx)


def test_route_with_capacity_or_every_expert_is_make_plans():
    logits = torch.randn(6, 8)
    for top_k, cf in [(2, 1.0), (2, -1.0), (8, 0.0)]:
        want = make_plan(softmax_topk(logits, top_k, True), 8, cf)
        got = route(logits, top_k, True, 8, cf)
        assert got.capacity == want.capacity and got.dropped == want.dropped
        for name in ("token_idx", "weights", "expert_ids", "counts", "by_expert"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None and b is None) or torch.equal(a, b)


def test_where_the_compiled_ops_do_not_run_the_torch_code_does(monkeypatch):
    x, w = torch.randn(2, 64).half(), torch.randn(64).half()
    assert step_ops.rms_norm(x, w, 1e-6) is None  # float16
    assert step_ops.rms_norm(torch.randn(64, 2).t(), torch.randn(64), 1e-6) is None  # D not unit-stride
    assert step_ops.rms_norm(torch.randn(2, 64), torch.randn(64).to(torch.bfloat16), 1e-6) is None  # mixed dtypes
    assert step_ops.rms_norm(torch.randn(2, 3, 4, 64), torch.randn(64), 1e-6) is None  # 4 dims
    torch.testing.assert_close(rms_norm(x, w, 1e-6), torch_rms_norm(x, w, 1e-6))
    monkeypatch.setenv(VARIANT_ENV, "torch")
    x, w = torch.randn(2, 64), torch.randn(64)
    assert step_ops.rms_norm(x, w, 1e-6) is None
    assert step_ops.add_rms_norm(x, x, w, 1e-6) is None
    assert step_ops.route_topk(x, 2, True) is None
    assert step_ops.argmax_logsumexp(x) is None
    s, h = add_rms_norm(x, x, w, 1e-6)
    assert torch.equal(s, x + x) and torch.equal(h, torch_rms_norm(x + x, w, 1e-6))


@pytest.mark.parametrize("variant", ["plain", *available_variants()])
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 255, 256, 257, 1000, 49152])
def test_argmax_logsumexp_matches_torch(variant, vocab):
    from kernels.cpu.build import extension

    torch.manual_seed(vocab)
    x = torch.randn(4, vocab) * 5
    x[1, vocab // 2] = 100.0  # one clear maximum
    x[2, vocab - 1] = x[2].max()  # a tie: the first one counts
    x[3] = x[3].round()  # many ties
    ids, top, lse = extension().argmax_logsumexp(x, variant)
    assert torch.equal(ids, torch.argmax(x, -1))
    assert torch.equal(top, x.max(-1).values)
    torch.testing.assert_close(lse, torch.logsumexp(x, -1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("variant", ["plain", *available_variants()])
def test_argmax_logsumexp_of_rows_with_nan_or_inf(variant):
    from kernels.cpu.build import extension

    inf, nan = float("inf"), float("nan")
    x = torch.randn(6, 300)
    x[0, 7] = x[0, 9] = nan  # the first NaN is the argmax
    x[1, 3] = x[1, 200] = inf  # the first +inf
    x[2] = -inf  # no distribution: index 0
    x[3, :100] = -inf  # partly masked: a sound row
    x[4, 250], x[4, 20] = -inf, nan
    x[5, 299] = inf
    ids, top, lse = extension().argmax_logsumexp(x, variant)
    assert ids.tolist() == torch.argmax(x, -1).tolist() == [7, 3, 0, ids[3].item(), 20, 299]
    assert torch.isnan(lse[[0, 1, 2, 4, 5]]).all() and torch.isnan(top[[0, 4]]).all()
    assert top[[1, 2, 5]].tolist() == [inf, -inf, inf]
    torch.testing.assert_close(lse[3], torch.logsumexp(x[3], -1), rtol=1e-6, atol=1e-6)


def test_argmax_logsumexp_bad_input_names_the_field():
    from kernels.cpu.build import extension

    ext = extension()
    for bad in (torch.randn(4), torch.randn(2, 4).double(), torch.randn(2, 0)):
        with pytest.raises(ValueError, match="logits"):
            ext.argmax_logsumexp(bad, "plain")
    with pytest.raises(ValueError, match="variant"):
        ext.argmax_logsumexp(torch.randn(2, 4), "sse9")
    assert step_ops.argmax_logsumexp(torch.randn(2, 4).double()) is None  # the torch ops take it
    assert step_ops.argmax_logsumexp(torch.randn(2, 4, 3)) is None


def sdpa_decode(q, k, v, meta, k_cache, v_cache):
    """paged_attention's decode rows on torch ops (SDPA), for the compiled call to match."""
    monkey = pytest.MonkeyPatch()
    monkey.setenv(VARIANT_ENV, "torch")
    try:
        return paged_attention(q, k, v, meta, k_cache, v_cache)
    finally:
        monkey.undo()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 5])
def test_decode_attention_matches_sdpa_and_writes_the_cache(dtype, window):
    g = torch.Generator().manual_seed(3)
    nh, kvh, d, bs = 8, 2, 64, 4
    # decodes at several lengths (one within a block, one over many blocks), tables of unequal length
    slices = [SeqSlice([5], 9, [0, 1, 2]), SeqSlice([7], 1, [3]), SeqSlice([1], 37, list(range(4, 14)))]
    meta = BatchMeta.build(slices, bs, window)
    heads = torch.randn(3, nh + 2 * kvh, d, generator=g).to(dtype)  # as the qkv projection lays them out
    q, k, v = heads[:, :nh], heads[:, nh : nh + kvh], heads[:, nh + kvh :]
    caches = [torch.randn(16, bs, kvh, d, generator=g).to(dtype) for _ in range(2)]
    want_caches = [c.clone() for c in caches]
    want = sdpa_decode(q, k, v, meta, *want_caches)
    got = step_ops.decode_attention(q, k, v, *caches, meta.slot_mapping, meta.decode_block_tables, meta.decode_mask)
    assert got is not None
    assert torch.equal(caches[0], want_caches[0]) and torch.equal(caches[1], want_caches[1])
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        assert (got != want).sum().item() <= 0.05 * want.numel()  # mostly the same bfloat16 values
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(paged_attention(q, k, v, meta, *[c.clone() for c in want_caches]), got, rtol=0, atol=0)


def test_decode_attention_leaves_chunks_to_torch():
    meta = BatchMeta.build([SeqSlice([5], 9, [0, 1, 2]), SeqSlice([1, 2, 3], 0, [3])], 4)
    q, k, v = torch.randn(4, 4, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 16)
    caches = [torch.randn(8, 4, 2, 16) for _ in range(2)]
    want_caches = [c.clone() for c in caches]
    torch.testing.assert_close(paged_attention(q, k, v, meta, *caches), sdpa_decode(q, k, v, meta, *want_caches))
