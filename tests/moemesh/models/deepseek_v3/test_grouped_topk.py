"""The grouped top-k sigmoid gate against transformers' DeepseekV3 router and against a literal,
loop-by-loop reading of the algorithm on adversarial inputs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moemesh.models.deepseek_v3.grouped_topk import grouped_topk


def literal_grouped_topk(logits, bias, top_k, n_group, topk_group, norm, scale):
    """The algorithm read literally, one token at a time, in float32 scalars; ties to the lower index."""
    f32 = np.float32
    ids_out, w_out = [], []
    for row in logits.tolist():
        # the float32 sigmoid of each logit (the same rounding as the gate's), then plain scalar steps
        scores = [f32(s) for s in torch.sigmoid(torch.tensor(row, dtype=torch.float32)).tolist()]
        offsets = bias.tolist() if bias is not None else [0.0] * len(row)
        biased = [s + f32(b) for s, b in zip(scores, offsets)]
        per = len(row) // n_group
        groups = []
        for g in range(n_group):
            members = sorted(biased[g * per : (g + 1) * per], reverse=True)
            groups.append((members[0] + members[1]) if per >= 2 else members[0])
        if topk_group < n_group:
            kept = sorted(range(n_group), key=lambda g: (-groups[g], g))[:topk_group]
        else:
            kept = list(range(n_group))
        candidates = [e for e in range(len(row)) if e // per in kept]
        chosen = sorted(candidates, key=lambda e: (-biased[e], e))[:top_k]
        w = [scores[e] for e in chosen]
        if norm:
            total = f32(0.0)
            for x in w:
                total = total + x
            w = [x / (total + f32(1e-20)) for x in w]
        ids_out.append(chosen)
        w_out.append([float(x * f32(scale)) for x in w])
    return torch.tensor(ids_out), torch.tensor(w_out, dtype=torch.float32)


def check_against_literal(logits, bias, top_k, n_group, topk_group, norm=True, scale=2.5):
    got = grouped_topk(logits, top_k, n_group, topk_group, bias, norm, scale)
    ids, w = literal_grouped_topk(logits, bias, top_k, n_group, topk_group, norm, scale)
    assert torch.equal(got.expert_ids, ids), (got.expert_ids, ids)
    torch.testing.assert_close(got.weights, w, rtol=1e-6, atol=1e-7)
    return got


def test_matches_transformers_router_on_random_inputs():
    import transformers as tf
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = tf.DeepseekV3Config(hidden_size=64, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                              routed_scaling_factor=2.5, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        router.e_score_correction_bias.normal_(0, 0.2)
    x = torch.randn(50, 64)
    logits, ref_w, ref_ids = router(x)
    got = grouped_topk(logits, 4, 4, 2, router.e_score_correction_bias, True, 2.5)
    # transformers returns the chosen experts unsorted; compare as (id -> weight) maps per token
    for t in range(50):
        ref = dict(zip(ref_ids[t].tolist(), ref_w[t].tolist()))
        mine = dict(zip(got.expert_ids[t].tolist(), got.weights[t].tolist()))
        assert ref.keys() == mine.keys()
        for e in ref:
            assert abs(ref[e] - mine[e]) < 1e-6


def test_all_ties_pick_lowest_indices():
    logits = torch.zeros(3, 8)
    got = check_against_literal(logits, None, top_k=3, n_group=4, topk_group=2)
    assert got.expert_ids.tolist() == [[0, 1, 2]] * 3
    torch.testing.assert_close(got.weights, torch.full((3, 3), 2.5 / 3))


def test_equal_group_scores_choose_lower_group():
    # groups of 2: g1 and g2 have exactly equal scores, both better than g0 and g3 -> g1 (the lower) wins
    logits = torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0, 1.0, -3.0, -3.0]])
    got = check_against_literal(logits, None, top_k=2, n_group=4, topk_group=1)
    assert got.expert_ids.tolist() == [[2, 3]]


def test_group_score_is_sum_of_top_two_not_max():
    # group 0 holds the single best expert but a poor second; group 1 has two good experts
    logits = torch.tensor([[4.0, -4.0, 1.5, 1.5, -5.0, -5.0, -5.0, -5.0]])
    got = check_against_literal(logits, None, top_k=2, n_group=4, topk_group=1)
    assert got.expert_ids.tolist() == [[2, 3]]


def test_bias_changes_selection_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -2.0, -3.0, 0.5, 0.25]])
    plain = check_against_literal(logits, None, top_k=2, n_group=1, topk_group=1, scale=1.0)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0, 0.0])
    biased = check_against_literal(logits, bias, top_k=2, n_group=1, topk_group=1, scale=1.0)
    assert plain.expert_ids.tolist() == [[0, 1]]
    assert biased.expert_ids.tolist() == [[5, 0]]
    s = torch.sigmoid(logits[0])
    expected = torch.stack([s[5], s[0]]) / (s[5] + s[0])
    torch.testing.assert_close(biased.weights[0], expected)


def test_bias_moves_group_selection():
    logits = torch.tensor([[3.0, 3.0, -1.0, -1.0, 0.0, 0.0, 0.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    got = check_against_literal(logits, bias, top_k=2, n_group=4, topk_group=1, norm=False, scale=1.0)
    assert got.expert_ids.tolist() == [[2, 3]]
    torch.testing.assert_close(got.weights[0], torch.sigmoid(torch.tensor([-1.0, -1.0])))


def test_routed_scaling_without_norm():
    logits = torch.tensor([[0.3, -0.2, 1.1, 0.0]])
    got = check_against_literal(logits, None, top_k=2, n_group=2, topk_group=2, norm=False, scale=2.5)
    torch.testing.assert_close(got.weights[0], 2.5 * torch.sigmoid(torch.tensor([1.1, 0.3])))


@pytest.mark.parametrize("bad", [dict(n_group=3), dict(topk_group=5), dict(top_k=5, topk_group=1)])
def test_bad_arguments_name_the_field(bad):
    args = dict(top_k=2, n_group=4, topk_group=2)
    args.update(bad)
    field = next(iter(bad))
    with pytest.raises(ValueError, match=field):
        grouped_topk(torch.zeros(2, 8), **args)


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    n_group=st.sampled_from([1, 2, 4]),
    per_group=st.sampled_from([1, 2, 4]),
    with_bias=st.booleans(),
    norm=st.booleans(),
)
def test_matches_literal_on_tie_heavy_inputs(data, n_group, per_group, with_bias, norm):
    experts = n_group * per_group
    topk_group = data.draw(st.integers(1, n_group))
    top_k = data.draw(st.integers(1, topk_group * per_group))
    # few distinct values -> many ties among experts and among groups
    values = st.sampled_from([-1.0, 0.0, 0.0, 0.5, 1.0])
    logits = torch.tensor(data.draw(st.lists(st.lists(values, min_size=experts, max_size=experts), min_size=1, max_size=4)))
    bias = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.0, 0.25, -0.25]), min_size=experts, max_size=experts))) if with_bias else None
    check_against_literal(logits, bias, top_k, n_group, topk_group, norm=norm, scale=1.5)
