import dataclasses

import grpc
import pytest
import torch

from expert_svc.shard import ExpertShard
from moemesh.checkpoint import CheckpointReader
from moemesh.errors import MeshError
from tests.fixtures.expert_servers import all_weights, expected, routed_request


def make_shard(tiny_model_dir, **kw):
    return ExpertShard.from_model_dir(str(tiny_model_dir), "auto", torch.device("cpu"), **kw)


def test_forward_is_the_weighted_partial_sum_on_a_subset(tiny_model_dir):
    cfg, weights = all_weights(tiny_model_dir)
    layer = cfg.moe_layers[1]
    shard = make_shard(tiny_model_dir)
    assert shard.load(layer, [6, 1, 3]) == (1, 3, 6)
    req = routed_request(20, [6, 1], layer=layer)
    torch.testing.assert_close(shard.forward(req), expected(req, weights[layer]))  # logical ids index the full set
    snap = shard.stats.snapshot()
    assert snap.tokens == {(layer, e): n for e, n in zip([6, 1], req.counts.tolist()) if n}
    assert sum(snap.tokens.values()) == req.token_idx.numel() and snap.requests == 1


def test_tokens_without_rows_get_zeros(tiny_model_dir):
    shard = make_shard(tiny_model_dir)
    shard.load(0, [2])
    req = routed_request(5, [2], top_k=1)
    req = dataclasses.replace(req, x=torch.randn(7, req.x.shape[1]))  # two more tokens, no row reads them
    y = shard.forward(req)
    assert y.shape == (7, req.x.shape[1]) and torch.equal(y[5:], torch.zeros(2, req.x.shape[1]))


def test_every_token_to_every_held_expert_takes_the_side_by_side_path_and_equals_moe_mlp(tiny_model_dir, monkeypatch):
    from moemesh.moe.concatenated_experts import ConcatenatedExperts

    side_by_side, real = [], ConcatenatedExperts.mlp
    monkeypatch.setattr(ConcatenatedExperts, "mlp", lambda self, *a: (side_by_side.append(1), real(self, *a))[1])
    cfg, weights = all_weights(tiny_model_dir)
    assert make_shard(tiny_model_dir).all_experts_path is False  # a sparse model: the layout never applies
    every = dataclasses.replace(cfg, top_k=cfg.num_experts)  # as for a model whose top-k is its number of experts
    shard = ExpertShard(CheckpointReader(tiny_model_dir), every, cfg.dtype, torch.device("cpu"))
    shard.load(0, [1, 4, 6])
    req = routed_request(6, [4, 1, 6], top_k=3)  # every token to each held expert, named out of order
    assert req.counts.tolist() == [6, 6, 6]
    torch.testing.assert_close(shard.forward(req), expected(req, weights[0]), rtol=1e-5, atol=1e-5)
    assert side_by_side == [1]
    shard.forward(routed_request(6, [4, 1], top_k=2))  # not every held expert: moe_mlp
    assert side_by_side == [1]
    off = make_shard(tiny_model_dir, all_experts_path=False)
    off.load(0, [1, 4, 6])
    assert off._layers[0].concatenated is None
    torch.testing.assert_close(off.forward(req), expected(req, weights[0]), rtol=1e-5, atol=1e-5)
    assert side_by_side == [1]


def test_unknown_experts_are_failed_precondition_and_named(tiny_model_dir):
    shard = make_shard(tiny_model_dir)
    shard.load(0, [0, 1])
    with pytest.raises(MeshError, match=r"layer 0: experts \[5\]") as e:
        shard.forward(routed_request(4, [1, 5]))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(MeshError, match="layer 1") as e:
        shard.forward(routed_request(4, [1, 5], layer=1))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_live_load_and_drop_keep_results_exact(tiny_model_dir):
    cfg, weights = all_weights(tiny_model_dir)
    shard = make_shard(tiny_model_dir)
    shard.load(0, [2])
    req = routed_request(9, [2, 7])
    shard.load(0, [7])
    got = shard.forward(req)
    at_once = make_shard(tiny_model_dir)
    at_once.load(0, [2, 7])
    torch.testing.assert_close(got, at_once.forward(req), rtol=0, atol=0)  # loaded live == at once
    torch.testing.assert_close(got, expected(req, weights[0]))  # float32 rounding: a subset of the experts held
    assert shard.drop(0, [2, 4]) == (7,)
    with pytest.raises(MeshError):
        shard.forward(req)
    assert shard.drop(0, [7]) == () and shard.held() == {}


def test_a_load_reads_only_the_experts_it_adds_and_a_drop_reads_none(tiny_model_dir, monkeypatch):
    import expert_svc.shard as shard_module

    shard = make_shard(tiny_model_dir)
    read = []
    real = shard_module.load_expert_weights
    monkeypatch.setattr(shard_module, "load_expert_weights", lambda r, m, layer, ids, *a: read.append((layer, list(ids))) or real(r, m, layer, ids, *a))
    shard.load(0, [5, 1])
    shard.load(0, [3, 1, 7])  # 1 is held: only 3 and 7 are read
    assert shard.drop(0, [5]) == (1, 3, 7)
    shard.load(0, [0])
    assert read == [(0, [1, 5]), (0, [3, 7]), (0, [0])] and shard.experts_read == 5
    at_once = make_shard(tiny_model_dir)
    at_once.load(0, [0, 1, 3, 7])
    for req in (routed_request(16, [7, 0, 3, 1]), routed_request(5, [0, 1, 3, 7], top_k=4)):  # grouped, and every expert side by side
        torch.testing.assert_close(shard.forward(req), at_once.forward(req), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4", "bf16"])
def test_growing_a_quantized_layer_keeps_its_experts_exact(tiny_model_dir, fmt):
    shard = make_shard(tiny_model_dir, experts_dtype=fmt)
    shard.load(1, [6, 2])
    shard.load(1, [4, 0])
    shard.drop(1, [2])
    at_once = make_shard(tiny_model_dir, experts_dtype=fmt)
    at_once.load(1, [0, 4, 6])
    req = routed_request(12, [4, 0, 6], layer=1)
    torch.testing.assert_close(shard.forward(req), at_once.forward(req), rtol=0, atol=0)


def test_slot_budget_is_resource_exhausted(tiny_model_dir):
    shard = make_shard(tiny_model_dir, slot_budget=3)
    shard.load(0, [0, 1])
    with pytest.raises(MeshError, match="slot_budget is 3") as e:
        shard.load(1, [0, 1])
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    shard.load(1, [5])
    assert shard.slots_used() == 3
    with pytest.raises(MeshError, match=r"expert_ids: \[8\]") as e:
        shard.load(1, [8])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def change(**fields):
    return lambda req: dataclasses.replace(req, **fields)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (change(layer=5), "layer: 5 is not a MoE layer"),
        (lambda r: dataclasses.replace(r, x=r.x[:, :32]), r"x: must be \[T, 64\]"),
        (lambda r: dataclasses.replace(r, x=r.x.to(torch.int32)), "x.dtype"),
        (lambda r: dataclasses.replace(r, x=r.x.double()), "x.dtype"),
        (change(expert_ids=torch.tensor([], dtype=torch.int64), counts=torch.tensor([], dtype=torch.int64)), "expert_ids: must name at least one"),
        (change(expert_ids=torch.tensor([0, 0]), counts=torch.tensor([3, 3])), "expert_ids: must name each expert once"),
        (change(expert_ids=torch.tensor([9, 0]), counts=torch.tensor([3, 3])), r"expert_ids: \[9\] are outside"),
        (lambda r: dataclasses.replace(r, counts=r.counts[:1]), "counts: must be int64 \\[G\\] = \\[2\\]"),
        (lambda r: dataclasses.replace(r, counts=r.counts + 1), "counts: must be >= 0 and sum to the 6 rows"),
        (lambda r: dataclasses.replace(r, counts=torch.tensor([7, -1])), "counts: must be >= 0"),
        (lambda r: dataclasses.replace(r, token_idx=r.token_idx.long()), "token_idx: must be int32"),
        (lambda r: dataclasses.replace(r, token_idx=r.token_idx + 2), r"token_idx: every value must index a row of x, in \[0, 3\)"),
        (lambda r: dataclasses.replace(r, token_idx=r.token_idx - 1), "token_idx: every value"),
        (lambda r: dataclasses.replace(r, weights=r.weights[:-1]), r"weights: must be float32 \[N\] = \[6\]"),
        (lambda r: dataclasses.replace(r, weights=r.weights.double()), "weights: must be float32"),
    ],
)
def test_malformed_requests_are_invalid_argument_naming_the_field(tiny_model_dir, mutate, match):
    shard = make_shard(tiny_model_dir)
    shard.load(0, [0, 1])
    req = routed_request(3, [0, 1], top_k=2)  # 6 rows: every token to both experts
    assert req.token_idx.numel() == 6
    with pytest.raises(MeshError, match=match) as e:
        shard.forward(mutate(req))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4", "nvfp4"])
def test_quantized_experts_match_the_in_process_engine(tiny_model_dir, fmt):
    from moemesh.checkpoint import CheckpointReader
    from moemesh.models.registry import load_model_config
    from moemesh.moe.local_experts import LocalExperts

    cfg = load_model_config(tiny_model_dir)
    local = LocalExperts.from_checkpoint(CheckpointReader(tiny_model_dir), cfg, torch.float32, fmt)
    shard = make_shard(tiny_model_dir, experts_dtype=fmt)
    shard.load(1, [3, 4, 6])
    req = routed_request(11, [6, 3], layer=1)
    torch.testing.assert_close(shard.forward(req), expected(req, local.layers[1].weights), rtol=1e-5, atol=1e-6)
