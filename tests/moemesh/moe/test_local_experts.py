import dataclasses

import pytest
import torch

from kernels import ExpertWeights
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
    want = moe_mlp(x, plan.token_idx, plan.weights, plan.expert_ids, plan.counts, w)
    torch.testing.assert_close(local(w).submit(0, x, plan).result(), want, rtol=0, atol=0)


def test_submit_equals_a_per_token_loop():
    w = weights()
    x = torch.randn(5, 16)
    plan = make_plan(softmax_topk(torch.randn(5, 4), 2, False), 4)
    out = local(w).submit(0, x, plan).result()
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
