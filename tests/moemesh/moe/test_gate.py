import pytest
import torch

from moemesh.moe.gate import softmax_topk


def test_topk_weights_renormalized_or_raw():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = torch.softmax(logits, -1)[0]
    raw = softmax_topk(logits, 2, normalize=False)
    assert raw.expert_ids.tolist() == [[0, 1]]
    torch.testing.assert_close(raw.weights[0], probs[:2])
    norm = softmax_topk(logits, 2, normalize=True)
    torch.testing.assert_close(norm.weights[0], probs[:2] / probs[:2].sum())
    assert norm.weights.dtype == torch.float32


def test_bad_top_k_names_field():
    with pytest.raises(ValueError, match="top_k"):
        softmax_topk(torch.zeros(3, 4), 5, normalize=True)




@pytest.mark.parametrize("normalize", [False, True])
def test_top_k_of_every_expert_keeps_the_weights_in_expert_order(normalize):
    logits = torch.randn(5, 4)
    every = softmax_topk(logits, 4, normalize)
    assert every.expert_ids is None  # no top-k sort: column e is expert e
    want = torch.softmax(logits, -1)
    torch.testing.assert_close(every.weights, want / want.sum(-1, keepdim=True) if normalize else want)
    if not normalize:  # the same weights as a top-k sort picks
        top = softmax_topk(logits, 3, normalize)
        torch.testing.assert_close(every.weights.gather(1, top.expert_ids), top.weights, rtol=0, atol=0)
