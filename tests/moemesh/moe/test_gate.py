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

