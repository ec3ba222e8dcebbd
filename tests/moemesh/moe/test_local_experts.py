import dataclasses

import pytest
import torch

from kernels import ExpertWeights
from kernels.cpu.variant import available_variants
from kernels.moe_mlp import moe_mlp
from moemesh.moe.dispatch import make_plan
from moemesh.moe.gate import softmax_topk
from moemesh.moe.layer_experts import LayerExperts
from moemesh.moe.local_experts import LocalExperts


def weights(e=4, h=16, i=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ExpertWeights(torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g))


def local(w: ExpertWeights) -> LocalExperts:
    return LocalExperts({0: LayerExperts.hold(range(w.num_experts), w, all_experts_path=False)})


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_submit_is_moe_mlp_over_the_plan(top_k):
    w = weights()
    g = torch.Generator().manual_seed(top_k)
    x = torch.randn(7, 16, generator=g)
    plan = make_plan(softmax_topk(torch.randn(7, 4, generator=g), top_k, True), 4)
    rows = plan.with_rows()  # top-k 4 of 4: the plan holds weights by expert, no rows
    want = moe_mlp(x, rows.token_idx, rows.weights, rows.expert_ids, rows.counts, w)
    torch.testing.assert_close(local(w).submit(0, x, plan), want, rtol=0, atol=0)  # no all-experts layout: the rows


def test_all_experts_plan_runs_the_experts_side_by_side():
    w = weights()
    g = torch.Generator().manual_seed(9)
    x = torch.randn(7, 16, generator=g)
    plan = make_plan(softmax_topk(torch.randn(7, 4, generator=g), 4, True), 4)
    held = LocalExperts({0: LayerExperts.hold(range(4), w)})
    assert plan.token_idx is None and held.layers[0].concatenated is not None
    got = held.submit(0, x, plan)
    assert isinstance(got, torch.Tensor)  # computed at once, no Future
    torch.testing.assert_close(got, held.layers[0].concatenated.mlp(x, plan.by_expert), rtol=0, atol=0)
    torch.testing.assert_close(got, local(w).submit(0, x, plan), rtol=1e-4, atol=1e-4)


def test_submit_equals_a_per_token_loop():
    w = weights()
    x = torch.randn(5, 16)
    plan = make_plan(softmax_topk(torch.randn(5, 4), 2, False), 4)
    out = local(w).submit(0, x, plan)
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
        local(weights()).submit(5, torch.randn(1, 16), plan)


def test_pack_and_the_all_experts_path_are_choices_at_load(tiny_ckpt):
    from moemesh.checkpoint import CheckpointReader
    from moemesh.models.registry import load_model_config

    path, _ = tiny_ckpt("mixtral")  # top-2: a sparse model
    reader, cfg = CheckpointReader(path), load_model_config(path)
    layer = cfg.moe_layers[0]
    # a sparse model holds no all-experts layout (its calls never take that path): its experts stay
    # [E, N, K] contiguous, as the compiled kernels read them
    default = LocalExperts.from_checkpoint(reader, cfg, torch.float32).layers[layer]
    assert default.concatenated is None and default.weights.gate_up.is_contiguous() and default.weights.down.is_contiguous()
    every = dataclasses.replace(cfg, top_k=cfg.num_experts)  # top-k == E: the layout, unless turned off
    assert LocalExperts.from_checkpoint(reader, every, torch.float32).layers[layer].concatenated is not None
    assert LocalExperts.from_checkpoint(reader, every, torch.float32, all_experts_path=False).layers[layer].concatenated is None
    if torch.backends.mkldnn.is_available():
        assert LocalExperts.from_checkpoint(reader, every, torch.bfloat16, pack=True).layers[layer].concatenated.gate_up.is_mkldnn
        assert not LocalExperts.from_checkpoint(reader, every, torch.bfloat16, pack=False).layers[layer].concatenated.gate_up.is_mkldnn


def test_decode_kernels_are_made_once_and_again_when_the_experts_change():
    """The one-call decode layer's hold of a layer's experts: made on first use, kept, made again when
    the layer's experts or their projections are replaced; None for a layer not held here."""
    if not available_variants():
        pytest.skip("the compiled CPU kernels do not run here")
    plain = weights()
    w = ExpertWeights(plain.gate_up.to(torch.bfloat16), plain.down.to(torch.bfloat16))
    held = local(w)
    first = held.decode_kernels(0)
    assert first is not None and held.decode_kernels(0) is first
    assert held.decode_kernels(1) is None  # no experts of layer 1 here
    other = weights(seed=1)
    w.gate_up, w.down = other.gate_up.to(torch.bfloat16), other.down.to(torch.bfloat16)  # projections replaced in place
    second = held.decode_kernels(0)
    assert second is not None and second is not first and held.decode_kernels(0) is second
    held.layers[0] = LayerExperts.hold(range(4), weights(seed=2), all_experts_path=False)
    third = held.decode_kernels(0)
    assert third is not None and third is not second
    held.layers[0] = LayerExperts.hold(range(4), ExpertWeights(torch.zeros(4, 16, 16, dtype=torch.float16), torch.zeros(4, 16, 8, dtype=torch.float16)), all_experts_path=False)
    assert held.decode_kernels(0) is None  # float16 experts: the kernels do not read them
