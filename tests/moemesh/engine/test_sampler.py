import torch

from moemesh.engine.sampler import filter_logits, sample, target_logprobs, top_logprobs
from moemesh.engine.sampling_params import SamplingParams


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isinf(filter_logits(logits, 2, 1.0)).tolist() == [False, False, True, True]
    # top_p 0.7: 0.5 alone is below 0.7, 0.5+0.3 reaches it -> keep two
    assert torch.isinf(filter_logits(logits, 0, 0.7)).tolist() == [False, False, True, True]
    assert torch.isinf(filter_logits(logits, 0, 0.5)).tolist() == [False, True, True, True]


def test_greedy_and_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])
    tokens, lps = sample(logits, [SamplingParams(temperature=0)] * 2, [None, None])
    assert tokens == [1, 0]
    torch.testing.assert_close(torch.tensor(lps), torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_seeded_sampling_is_reproducible_and_row_independent():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=1.0, seed=1)

    def draw(rows):
        gens = [torch.Generator().manual_seed(1) for _ in rows]
        return sample(logits[rows], [p] * len(rows), gens)[0]

    alone = draw([2])
    with_neighbours = draw([0, 1, 2])
    assert with_neighbours[2] == alone[0]


def test_target_logprobs_pick_each_rows_target():
    logits = torch.randn(3, 10)
    out = target_logprobs(logits, [2, 3, 9])
    assert len(out) == 3
    assert out == [torch.log_softmax(logits[i], -1)[t].item() for i, t in enumerate([2, 3, 9])]


def test_top_logprobs_per_row():
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0], [2.0, 0.0, 0.5, 0.0]])
    lp = torch.log_softmax(logits, -1)
    out = top_logprobs(logits, [2, 0])
    assert [t for t, _ in out[0]] == [1, 2] and out[1] is None
    torch.testing.assert_close(torch.tensor([v for _, v in out[0]]), lp[0, [1, 2]])
    assert top_logprobs(logits, [0, 0]) == [None, None]
    assert len(top_logprobs(logits, [9, 1])[0]) == 4  # at most the vocabulary
