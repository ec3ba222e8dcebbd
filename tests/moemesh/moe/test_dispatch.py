"""Dispatch plan and capacity factor semantics (Tutel's convention)."""
import math

import pytest
import torch

from moemesh.moe.dispatch import expert_capacity, make_plan
from moemesh.moe.gate import Routing, softmax_topk


def routing(ids, weights=None):
    ids = torch.tensor(ids, dtype=torch.long)
    w = torch.full(ids.shape, 0.5) if weights is None else torch.tensor(weights)
    return Routing(ids, w)


def test_rows_sorted_by_expert_with_counts():
    plan = make_plan(routing([[2, 0], [0, 3], [2, 3]]), num_experts=4)
    assert plan.expert_ids.tolist() == [0, 2, 3]
    assert plan.counts.tolist() == [2, 2, 2]
    # first choices before second choices inside an expert, tokens in order
    assert plan.token_idx.tolist() == [1, 0, 0, 2, 1, 2]
    assert plan.capacity is None and plan.dropped == 0


def test_positive_capacity_factor_caps_and_drops_overflow():
    # 4 tokens, top-1, 2 experts, all to expert 0; cf=1 -> capacity ceil(1*1*4/2) = 2
    plan = make_plan(routing([[0], [0], [0], [1]]), num_experts=2, capacity_factor=1.0)
    assert plan.capacity == 2
    assert plan.counts.tolist() == [2, 1]
    assert plan.token_idx.tolist() == [0, 1, 3]
    assert plan.dropped == 1


def test_positive_capacity_pads_to_fixed_size_even_when_not_full():
    plan = make_plan(routing([[0], [1], [0], [1]]), num_experts=2, capacity_factor=2.0)
    assert plan.capacity == math.ceil(1 * 2.0 * 4 / 2)
    assert plan.dropped == 0


def test_zero_capacity_factor_is_dropless():
    plan = make_plan(routing([[0]] * 10), num_experts=4, capacity_factor=0.0)
    assert plan.capacity is None and plan.counts.tolist() == [10] and plan.dropped == 0


def test_negative_capacity_factor_dropless_up_to_bound():
    skewed = routing([[0]] * 6 + [[1]] * 2)  # T=8, k=1, E=2: bound ceil(|cf|*8/2)
    within = make_plan(skewed, num_experts=2, capacity_factor=-2.0)  # bound 8 >= busiest 6
    assert within.capacity == 6 and within.dropped == 0
    capped = make_plan(skewed, num_experts=2, capacity_factor=-1.0)  # bound 4 < 6
    assert capped.capacity == 4 and capped.dropped == 2 and capped.counts.tolist() == [4, 2]


def test_second_choices_dropped_before_first_choices():
    # expert 0 is token 0's second choice and tokens 1, 2's first; capacity 2 keeps tokens 1 and 2
    plan = make_plan(routing([[1, 0], [0, 1], [0, 1]]), num_experts=2, capacity_factor=2 / 3)
    assert plan.capacity == 2
    rows0 = plan.token_idx[: plan.counts[0]].tolist()
    assert rows0 == [1, 2]


def test_expert_capacity_formula():
    assert expert_capacity(10, 4, 2, 1.25, max_count=9) == math.ceil(2 * 1.25 * 10 / 4)
    assert expert_capacity(10, 4, 2, 0.0, max_count=9) is None
    assert expert_capacity(10, 4, 2, -1.0, max_count=3) == 3


def test_dropped_pairs_contribute_nothing():
    from kernels import ExpertWeights
    from kernels.moe_mlp import moe_mlp

    torch.manual_seed(0)
    t, h = 6, 5
    r = routing([[0, 1]] * t, torch.rand(t, 2).tolist())
    plan = make_plan(r, num_experts=2, capacity_factor=0.5)  # capacity ceil(2*.5*6/2)=3 per expert
    assert plan.dropped == 6
    assert set(plan.token_idx.tolist()) == {0, 1, 2}  # tokens 3..5 lost both choices (priority to earlier tokens)
    w = ExpertWeights(torch.randn(2, 8, h), torch.randn(2, h, 4))
    out = moe_mlp(torch.randn(t, h), plan.token_idx, plan.weights, plan.expert_ids, plan.counts, w)
    assert out[3:].abs().sum() == 0


@pytest.mark.parametrize("cf", [0.0, 1.0, -1.5])
def test_plan_rows_cover_each_kept_pair_once(cf):
    torch.manual_seed(1)
    logits = torch.randn(20, 8)
    r = Routing(*reversed(torch.topk(torch.softmax(logits, -1), 2, dim=-1)))
    plan = make_plan(r, 8, cf)
    assert int(plan.counts.sum()) == plan.num_rows == 40 - plan.dropped
    pairs = set(zip(plan.token_idx.tolist(), torch.repeat_interleave(plan.expert_ids, plan.counts).tolist()))
    assert len(pairs) == plan.num_rows
    assert pairs <= {(t, e) for t in range(20) for e in r.expert_ids[t].tolist()}


def test_all_experts_per_token_gives_every_pair_in_expert_then_token_order():
    torch.manual_seed(2)
    t, e = 5, 4
    probs = torch.softmax(torch.randn(t, e), -1)
    weights, ids = torch.topk(probs, e, dim=-1)
    plan = make_plan(Routing(ids, weights), num_experts=e)
    assert plan.token_idx is None and plan.num_rows == t * e
    torch.testing.assert_close(plan.by_expert, probs, rtol=0, atol=0)  # the weights back in expert order
    plan = plan.with_rows()
    assert plan.counts.tolist() == [t] * e and plan.expert_ids.tolist() == list(range(e))
    assert plan.token_idx.tolist() == list(range(t)) * e
    experts = torch.repeat_interleave(plan.expert_ids, plan.counts)
    torch.testing.assert_close(plan.weights, probs[plan.token_idx, experts])


def test_binding_capacity_with_all_experts_falls_back_to_dropping():
    ids = torch.tensor([[0, 1]] * 4)
    plan = make_plan(Routing(ids, torch.full((4, 2), 0.5)), num_experts=2, capacity_factor=0.5)  # capacity 2 < 4
    assert plan.by_expert is None and plan.capacity == 2 and plan.dropped == 4


@pytest.mark.parametrize("num_tokens", [1, 2, 7])
def test_dropless_plan_matches_the_counted_path(num_tokens):
    # cf == 0 takes its groups from the sorted ids; a negative cf whose bound never binds (capacity =
    # the busiest expert's load) goes through the per-expert counts: same rows, groups and weights
    g = torch.Generator().manual_seed(num_tokens)
    ids = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(num_tokens)])  # [T, 4]
    r = Routing(ids, torch.rand(num_tokens, 4, generator=g))
    fast, counted = make_plan(r, 16, 0.0), make_plan(r, 16, -100.0)
    assert counted.dropped == 0 and fast.capacity is None
    for name in ("token_idx", "weights", "expert_ids", "counts"):
        a, b = getattr(fast, name), getattr(counted, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_all_experts_gate_output_gives_a_plan_without_rows_and_its_rows_on_request():
    torch.manual_seed(5)
    t, e = 6, 4
    logits = torch.randn(t, e)
    plan = make_plan(softmax_topk(logits, e, True), e)
    assert plan.by_expert is not None and plan.token_idx is None
    torch.testing.assert_close(plan.by_expert, torch.softmax(logits, -1), rtol=1e-6, atol=1e-7)
    rows = plan.with_rows()
    assert rows.token_idx.tolist() == list(range(t)) * e and rows.counts.tolist() == [t] * e
    torch.testing.assert_close(rows.weights, plan.by_expert.t().reshape(-1), rtol=0, atol=0)
    assert rows.with_rows() is rows and make_plan(softmax_topk(logits, 2, True), e).by_expert is None


def test_binding_capacity_on_the_all_experts_gate_output_keeps_choice_order_priority():
    # the gate leaves every expert in expert order; when capacity binds, the plan drops as if the
    # choices had been sorted by weight (first choices before second ones)
    torch.manual_seed(6)
    logits = torch.randn(8, 4)
    every = softmax_topk(logits, 4, False)
    sorted_ = Routing(*reversed(torch.topk(every.weights, 4, dim=-1)))
    for cf in (0.5, -0.25):
        got, want = make_plan(every, 4, cf), make_plan(sorted_, 4, cf)
        assert got.by_expert is None and got.dropped == want.dropped > 0
        for name in ("token_idx", "weights", "expert_ids", "counts"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
    empty = make_plan(softmax_topk(torch.randn(0, 4), 4, True), 4)
    assert empty.num_rows == 0 and empty.by_expert is None
