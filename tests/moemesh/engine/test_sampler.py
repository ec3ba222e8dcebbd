import pytest
import torch

from kernels.cpu.variant import VARIANT_ENV, available_variants
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
    (t0, lp0), (t1, lp1) = sample(logits, [SamplingParams(temperature=0)] * 2, [None, None])
    tokens, lps = [t0, t1], [lp0, lp1]
    assert tokens == [1, 0]
    torch.testing.assert_close(torch.tensor(lps), torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_seeded_sampling_is_reproducible_and_row_independent():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=1.0, seed=1)

    def draw(rows):
        gens = [torch.Generator().manual_seed(1) for _ in rows]
        return [tok for tok, _ in sample(logits[rows], [p] * len(rows), gens)]

    alone = draw([2])
    with_neighbours = draw([0, 1, 2])
    assert with_neighbours[2] == alone[0]


def test_top_p_rounding_to_zero_keeps_the_top_token():
    logits = torch.log(torch.tensor([0.2, 0.5, 0.3]))
    for top_p in (1e-300, 1e-46, 5e-324):
        assert torch.isinf(filter_logits(logits, 0, top_p)).tolist() == [True, False, True]


def test_a_row_with_nan_or_inf_logits_fails_alone():
    logits = torch.tensor([[0.0, 3.0, 1.0], [float("nan"), 0.0, 0.0], [float("inf"), 0.0, 0.0], [float("-inf")] * 3])
    out = sample(logits, [SamplingParams(temperature=0.7, seed=1)] * 4, [torch.Generator().manual_seed(1) for _ in range(4)])
    assert out[0][0] in (0, 1, 2)
    for failed in out[1:]:
        assert isinstance(failed, RuntimeError) and str(failed).startswith("logits: ")


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


def test_greedy_rows_with_nan_or_inf_logits_fail_and_partly_masked_rows_do_not():
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor(
        [[0.0, 3.0, -inf], [0.0, nan, 1.0], [0.0, 1.0, inf], [-inf] * 3, [1.0, inf, nan], [-inf, -inf, 2.0]]
    )
    out = sample(logits, [SamplingParams(temperature=0.0)] * 6, [None] * 6)
    assert out[0][0] == 1 and out[5] == (2, 0.0)
    for failed in out[1:5]:
        assert isinstance(failed, RuntimeError) and str(failed).startswith("logits: ")


@pytest.mark.parametrize("kernel", ["torch", *available_variants()])
def test_the_compiled_and_the_torch_argmax_sample_alike(monkeypatch, kernel):
    """The CPU kernels' one pass (argmax, its logit, logsumexp) and torch's ops give the same tokens, the
    same log-probabilities to float rounding and the same failures, for greedy and drawn rows."""
    monkeypatch.setenv(VARIANT_ENV, kernel)
    torch.manual_seed(0)
    logits = torch.randn(5, 49152) * 4
    logits[1, 77] = float("nan")
    logits[3, :1000] = float("-inf")
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=3),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=50, seed=4)]
    gens = [None, None, torch.Generator().manual_seed(3), None, torch.Generator().manual_seed(4)]
    out = sample(logits, params, gens)
    lp = torch.log_softmax(logits.double(), -1)
    assert isinstance(out[1], RuntimeError) and str(out[1]).startswith("logits: ")
    assert out[0][0] == int(torch.argmax(logits[0])) and out[3][0] == int(torch.argmax(logits[3]))
    for b in (0, 2, 3, 4):
        token, got = out[b]
        assert abs(got - lp[b, token].item()) < 1e-4
    monkeypatch.setenv(VARIANT_ENV, "torch")
    again = sample(logits, params, [None, None, torch.Generator().manual_seed(3), None, torch.Generator().manual_seed(4)])
    assert [o[0] for o in again if not isinstance(o, Exception)] == [o[0] for o in out if not isinstance(o, Exception)]
