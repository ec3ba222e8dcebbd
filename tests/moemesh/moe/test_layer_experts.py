"""`LayerExperts`: the all-experts branch (experts side by side) equals `kernels.moe_mlp`, is taken only
when the rows send every token to every held expert, and can be turned off."""
import pytest
import torch

from kernels import ExpertWeights
from kernels.moe_mlp import moe_mlp
from moemesh.moe.dispatch import make_plan
from moemesh.moe.gate import softmax_topk
from moemesh.moe.layer_experts import LayerExperts, pack_by_default, routes_every_token


def weights(e=4, h=16, i=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return ExpertWeights(torch.randn(e, 2 * i, h, generator=g).to(dtype), torch.randn(e, h, i, generator=g).to(dtype))


def all_experts_plan(t, e, seed=0):
    """A top-k == E plan (weights by expert, no rows)."""
    g = torch.Generator().manual_seed(seed)
    plan = make_plan(softmax_topk(torch.randn(t, e, generator=g), e, True), e)
    assert plan.by_expert is not None
    return plan


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_experts_branch_equals_moe_mlp(dtype):
    w = weights(dtype=dtype)
    held, plain = LayerExperts.hold(range(4), w), LayerExperts.hold(range(4), w, all_experts_path=False)
    assert held.concatenated is not None and plain.concatenated is None
    x = torch.randn(5, 16).to(dtype)
    plan = all_experts_plan(5, 4)
    by_expert, plan = plan.by_expert, plan.with_rows()
    rows = (x, plan.token_idx, plan.weights, plan.expert_ids, plan.counts)
    want = moe_mlp(*rows, w)
    # other kernels, rounded at other points: bf16 within 2% of the output's scale (a row's experts
    # partly cancel, so an element's own magnitude is no measure of its rounding)
    tol = dict(rtol=0, atol=0.02 * float(want.abs().max())) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(held.every_expert(x, by_expert), want, **tol)
    torch.testing.assert_close(held(*rows), want, **tol)  # found from the rows
    assert plain.every_expert(x, by_expert) is None  # the branch is off
    torch.testing.assert_close(plain(*rows), want, rtol=0, atol=0)


def test_all_experts_branch_with_experts_named_out_of_order():
    """A server may receive its experts in any order: the weights land on the right experts."""
    w = weights()
    held = LayerExperts.hold([3, 5, 6, 9], w)
    t = 3
    g = torch.Generator().manual_seed(4)
    x = torch.randn(t, 16, generator=g)
    order = torch.tensor([2, 0, 3, 1])  # local indices
    token_idx = torch.arange(t).repeat(4)
    row_w = torch.rand(4 * t, generator=g)
    counts = torch.full((4,), t)
    assert routes_every_token(t, token_idx, order, counts, 4)
    # other kernels, rounded at other points (as in test_all_experts_branch_equals_moe_mlp)
    torch.testing.assert_close(held(x, token_idx, row_w, order, counts), moe_mlp(x, token_idx, row_w, order, counts, w),
                               rtol=1e-4, atol=1e-4)


def test_sparse_rows_never_take_the_all_experts_branch():
    t = 6
    # three of four experts, or every expert with one token missing, or tokens out of order
    assert not routes_every_token(t, torch.arange(t).repeat(3), torch.arange(3), torch.full((3,), t), 4)
    assert not routes_every_token(t, torch.arange(t - 1).repeat(4), torch.arange(4), torch.full((4,), t - 1), 4)
    assert not routes_every_token(t, torch.arange(t).flip(0).repeat(4), torch.arange(4), torch.full((4,), t), 4)
    w = weights()
    held = LayerExperts.hold(range(4), w)
    g = torch.Generator().manual_seed(1)
    plan = make_plan(softmax_topk(torch.randn(t, 4, generator=g), 2, True), 4)
    x = torch.randn(t, 16, generator=g)
    rows = (x, plan.token_idx, plan.weights, plan.expert_ids, plan.counts)
    torch.testing.assert_close(held(*rows), moe_mlp(*rows, held.weights), rtol=0, atol=0)  # the moe_mlp path itself


def test_concatenated_layout_is_the_same_storage():
    held = LayerExperts.hold(range(4), weights())
    assert held.weights.down.data_ptr() == held.concatenated.down.data_ptr()
    assert held.weights.gate_up.data_ptr() == held.concatenated.gate_up.data_ptr()


def test_no_rows_give_zeros():
    held = LayerExperts.hold(range(4), weights())
    x = torch.randn(3, 16)
    empty = torch.empty(0, dtype=torch.long)
    assert torch.equal(held(x, empty, torch.empty(0), empty, empty), torch.zeros(3, 16))


def test_packed_bf16_equals_unpacked():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN not available")
    g = torch.Generator().manual_seed(3)
    w = ExpertWeights(torch.randn(4, 32, 64, generator=g).bfloat16(), torch.randn(4, 64, 16, generator=g).bfloat16())
    plain, packed = LayerExperts.hold(range(4), w), LayerExperts.hold(range(4), w).packed()
    assert packed.concatenated.gate_up.is_mkldnn and not plain.concatenated.gate_up.is_mkldnn
    for t in (1, 5):
        x = torch.randn(t, 64, generator=g).bfloat16()
        by_expert = all_experts_plan(t, 4, seed=t).by_expert
        torch.testing.assert_close(packed.every_expert(x, by_expert), plain.every_expert(x, by_expert))


def test_packs_by_default_only_for_all_experts_models_where_it_applies_and_fits(monkeypatch):
    import types

    from moemesh.moe import layer_experts

    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN not available")
    cpu, before = torch.device("cpu"), torch.get_num_threads()
    monkeypatch.setattr(layer_experts.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=4000))
    try:
        torch.set_num_threads(1)
        assert pack_by_default(8, 8, torch.bfloat16, cpu, 1000)
        assert not pack_by_default(8, 8, torch.bfloat16, cpu, 1001)  # over a quarter of the memory available
        assert not pack_by_default(2, 8, torch.bfloat16, cpu, 10)  # a sparse model never uses the copy
        assert not pack_by_default(8, 8, torch.float32, cpu, 10)  # MKL's float32 layout is faster on one thread
        torch.set_num_threads(2)
        assert pack_by_default(8, 8, torch.float32, cpu, 10)
    finally:
        torch.set_num_threads(before)
