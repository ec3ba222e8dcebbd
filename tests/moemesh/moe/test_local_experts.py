import pytest
import torch

from kernels import ExpertWeights
from kernels.moe_mlp import moe_mlp
from moemesh.moe.dispatch import make_plan
from moemesh.moe.gate import softmax_topk
from moemesh.moe.local_experts import LocalExperts


def weights(e=4, h=16, i=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ExpertWeights(torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g))


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_submit_is_moe_mlp_over_the_plan(top_k):
    w = weights()
    local = LocalExperts.of({0: w})
    g = torch.Generator().manual_seed(top_k)
    x = torch.randn(7, 16, generator=g)
    plan = make_plan(softmax_topk(torch.randn(7, 4, generator=g), top_k, True), 4)
    want = moe_mlp(x, plan.token_idx, plan.weights, plan.expert_ids, plan.counts, w)
    torch.testing.assert_close(local.submit(0, x, plan).result(), want)


def test_submit_equals_a_per_token_loop():
    w = weights()
    x = torch.randn(5, 16)
    plan = make_plan(softmax_topk(torch.randn(5, 4), 2, False), 4)
    out = LocalExperts.of({0: w}).submit(0, x, plan).result()
    want = torch.zeros(5, 16)
    start = 0
    for e, n in zip(plan.expert_ids.tolist(), plan.counts.tolist()):
        for r in range(start, start + n):
            t = int(plan.token_idx[r])
            h = x[t] @ w.gate_up[e].t()
            want[t] += plan.weights[r] * ((torch.nn.functional.silu(h[:8]) * h[8:]) @ w.down[e].t())
        start += n
    torch.testing.assert_close(out, want)


def test_unknown_layer_is_an_error():
    plan = make_plan(softmax_topk(torch.randn(1, 4), 1, True), 4)
    with pytest.raises(ValueError, match="layer 5"):
        LocalExperts.of({0: weights()}).submit(5, torch.randn(1, 16), plan)


def test_pack_and_the_all_experts_path_are_constructor_choices():
    w = weights()
    assert LocalExperts.of({0: w}).layers[0].concatenated is not None
    assert LocalExperts.of({0: w}, all_experts_path=False).layers[0].concatenated is None
    if torch.backends.mkldnn.is_available():
        bf16 = ExpertWeights(w.gate_up.bfloat16(), w.down.bfloat16())
        assert LocalExperts.of({0: bf16}, pack=True).layers[0].concatenated.gate_up.is_mkldnn
        assert not LocalExperts.of({0: bf16}).layers[0].concatenated.gate_up.is_mkldnn
