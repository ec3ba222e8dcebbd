import torch

from kernels import ExpertWeights, grouped_expert_mlp
from moemesh.moe.local_experts import LocalExperts


def weights(e=4, h=16, i=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ExpertWeights(torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g))


def test_uniform_counts_batched_path_equals_grouped_reference():
    w = weights()
    local = LocalExperts({0: w})
    x = torch.randn(12, 16)
    ids, counts = torch.tensor([0, 1, 2, 3]), torch.tensor([3, 3, 3, 3])
    torch.testing.assert_close(local.submit(0, x, ids, counts).result(), grouped_expert_mlp(x, ids, counts, w))
    sub_ids = torch.tensor([1, 3])  # a subset with uniform counts
    x2 = torch.randn(4, 16)
    torch.testing.assert_close(
        local.submit(0, x2, sub_ids, torch.tensor([2, 2])).result(), grouped_expert_mlp(x2, sub_ids, torch.tensor([2, 2]), w)
    )


def test_ragged_counts_equal_per_expert_loop():
    w = weights()
    local = LocalExperts({0: w})
    x = torch.randn(7, 16)
    out = local.submit(0, x, torch.tensor([0, 2, 3]), torch.tensor([4, 1, 2])).result()
    start = 0
    for e, n in [(0, 4), (2, 1), (3, 2)]:
        h = x[start : start + n] @ w.gate_up[e].t()
        ref = (torch.nn.functional.silu(h[:, :8]) * h[:, 8:]) @ w.down[e].t()
        torch.testing.assert_close(out[start : start + n], ref)
        start += n


def test_unknown_layer_is_an_error():
    import pytest

    with pytest.raises(ValueError, match="layer 5"):
        LocalExperts({0: weights()}).submit(5, torch.randn(1, 16), torch.tensor([0]), torch.tensor([1]))


def test_submit_all_equals_uniform_dispatch_and_combine():
    from moemesh.moe.dispatch import make_plan
    from moemesh.moe.combine import combine
    from moemesh.moe.gate import softmax_all, softmax_topk

    w = weights()
    local = LocalExperts({0: w})
    x = torch.randn(5, 16)
    logits = torch.randn(5, 4)
    plan = make_plan(softmax_topk(logits, 4, True), 4)
    assert plan.uniform
    ref = combine(grouped_expert_mlp(x[plan.token_idx], plan.expert_ids, plan.counts, w), plan, 5)
    torch.testing.assert_close(local.submit_all(0, x, softmax_all(logits, True)).result(), ref)
    assert local.submit_all(0, x.double(), softmax_all(logits, True)) is None  # not in the held dtype


def test_concatenated_layout_keeps_the_grouped_path_exact():
    w = weights()
    local = LocalExperts({0: w}, pack=False)
    held = local.weights[0]  # one copy held: the [E, .., ..] weights are views of the concatenated ones
    assert held.down.data_ptr() == local.concatenated[0].down.data_ptr()
    assert held.gate_up.data_ptr() == local.concatenated[0].gate_up.data_ptr()
    x = torch.randn(7, 16)
    ids, counts = torch.tensor([0, 2, 3]), torch.tensor([4, 1, 2])
    torch.testing.assert_close(local.submit(0, x, ids, counts).result(), grouped_expert_mlp(x, ids, counts, w))


def test_packed_bf16_submit_all_equals_unpacked():
    import pytest

    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN not available")
    g = torch.Generator().manual_seed(3)
    w = ExpertWeights(torch.randn(4, 32, 64, generator=g).bfloat16(), torch.randn(4, 64, 16, generator=g).bfloat16())
    plain, packed = LocalExperts({0: w}, pack=False), LocalExperts({0: w}, pack=True)
    assert packed.concatenated[0].gate_up.is_mkldnn
    for t in (1, 5):
        x = torch.randn(t, 64, generator=g).bfloat16()
        gates = torch.softmax(torch.randn(t, 4, generator=g), -1)
        torch.testing.assert_close(packed.submit_all(0, x, gates).result(), plain.submit_all(0, x, gates).result())
    ids, counts = torch.tensor([0, 2]), torch.tensor([3, 1])  # the grouped path keeps the plain weights
    x = torch.randn(4, 64, generator=g).bfloat16()
    torch.testing.assert_close(packed.submit(0, x, ids, counts).result(), plain.submit(0, x, ids, counts).result())


def test_packs_by_default_only_where_it_applies_and_fits(monkeypatch):
    import types

    import pytest

    from moemesh.moe import local_experts

    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN not available")
    before = torch.get_num_threads()
    bf16 = ExpertWeights(weights().gate_up.bfloat16(), weights().down.bfloat16())
    try:
        torch.set_num_threads(2)
        assert LocalExperts({0: bf16}).concatenated[0].gate_up.is_mkldnn
        assert LocalExperts({0: weights()}).concatenated[0].gate_up.is_mkldnn  # float32 with 2 threads
        torch.set_num_threads(1)
        assert not LocalExperts({0: weights()}).concatenated[0].gate_up.is_mkldnn  # MKL's layout is faster
        assert LocalExperts({0: bf16}).concatenated[0].gate_up.is_mkldnn
        copy_bytes = (bf16.gate_up.numel() + bf16.down.numel()) * 2  # the packed copy, bfloat16
        monkeypatch.setattr(local_experts.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=4 * copy_bytes - 1))
        assert not LocalExperts({0: bf16}).concatenated[0].gate_up.is_mkldnn  # would take over a quarter
        assert LocalExperts({0: bf16}, pack=True).concatenated[0].gate_up.is_mkldnn  # asked for
        monkeypatch.setattr(local_experts.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=4 * copy_bytes))
        assert LocalExperts({0: bf16}).concatenated[0].gate_up.is_mkldnn
    finally:
        torch.set_num_threads(before)
