"""The opt-in DequantizedWeights store: same outputs as without it, filled once, bounded, caller-owned."""
import pytest
import torch

import kernels.grouped_torch as gt
from kernels import DequantizedWeights, grouped_expert_mlp, prepare_experts
from tests.kernels.test_grouped_mlp import make_weights

FORMATS = ["fp8", "mxfp4", "nvfp4"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_are_identical_with_and_without_the_store(fmt, dtype, monkeypatch):
    w = prepare_experts(make_weights(bias=True, activation="swiglu_oai"), fmt, dtype)
    cache = DequantizedWeights()
    for budget in (gt.DEQUANT_BUDGET_BYTES, 1):  # all experts in one chunk, then one expert per chunk
        monkeypatch.setattr(gt, "DEQUANT_BUDGET_BYTES", budget)
        for expert_idx, counts in [([4, 0, 2, 5, 1], [3, 0, 1, 7, 2]), ([1, 2, 3], [2, 2, 2]), ([5], [1])]:
            expert_idx, counts = torch.tensor(expert_idx), torch.tensor(counts)
            x = torch.randn(int(counts.sum()), 64).to(dtype)
            want = grouped_expert_mlp(x, expert_idx, counts, w)
            got = grouped_expert_mlp(x, expert_idx, counts, w, cache=cache)
            assert torch.equal(got, want)
    assert cache.nbytes == sum(t.shape.numel() for t in (w.gate_up, w.down)) * x.element_size()


def test_each_expert_is_dequantized_once(monkeypatch):
    w = prepare_experts(make_weights(), "mxfp4", torch.float32)
    calls = []
    real = type(w.gate_up).dequantize

    def counting(self, dtype=torch.float32, experts=None):
        calls.append(experts.tolist())
        return real(self, dtype, experts)

    monkeypatch.setattr(type(w.gate_up), "dequantize", counting)
    cache = DequantizedWeights()
    x = torch.randn(3, 64)
    grouped_expert_mlp(x, torch.tensor([1, 3]), torch.tensor([1, 2]), w, cache=cache)
    grouped_expert_mlp(x, torch.tensor([3, 4]), torch.tensor([2, 1]), w, cache=cache)
    assert calls == [[1, 3], [1, 3], [4], [4]]  # gate_up and down; expert 3 only the first time
    cache.clear()
    assert cache.nbytes == 0


def test_max_bytes_evicts_least_recently_used_and_skips_oversized_entries():
    a = prepare_experts(make_weights(seed=1), "nvfp4", torch.float32)
    b = prepare_experts(make_weights(seed=2), "nvfp4", torch.float32)
    one = a.gate_up.shape.numel() * 4  # bytes of one dense gate_up in float32
    ids = torch.tensor([0, 2])
    cache = DequantizedWeights(max_bytes=one)
    assert torch.equal(cache.experts(a.gate_up, torch.float32, ids), a.gate_up.dequantize(torch.float32, ids))
    assert cache.nbytes == one
    assert torch.equal(cache.experts(b.gate_up, torch.float32, ids), b.gate_up.dequantize(torch.float32, ids))
    assert cache.nbytes == one  # a's entry was evicted
    tiny = DequantizedWeights(max_bytes=one - 1)
    assert torch.equal(tiny.experts(a.gate_up, torch.float32, ids), a.gate_up.dequantize(torch.float32, ids))
    assert tiny.nbytes == 0


def test_consecutive_experts_are_views_and_dense_weights_pass_through():
    w = prepare_experts(make_weights(), "fp8", torch.bfloat16)
    cache = DequantizedWeights()
    first = cache.experts(w.down, torch.bfloat16, torch.tensor([2, 3]))
    again = cache.experts(w.down, torch.bfloat16, torch.tensor([2, 3]))
    assert again.data_ptr() == first.data_ptr()
    dense = make_weights().down
    assert torch.equal(cache.experts(dense, torch.float32, torch.tensor([1])), dense[1:2])
    assert cache.nbytes == w.down.shape.numel() * 2


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="max_bytes"):
        DequantizedWeights(max_bytes=-1)
    w = make_weights()
    with pytest.raises(ValueError, match="cache"):
        grouped_expert_mlp(torch.randn(1, 64), torch.tensor([0]), torch.tensor([1]), w, cache={})
