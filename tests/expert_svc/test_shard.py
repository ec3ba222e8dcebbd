import pytest
import torch

from expert_svc.errors import BadForward, OverBudget, UnknownExperts
from expert_svc.shard import ExpertShard
from kernels import grouped_expert_mlp
from tests.expert_svc.fixtures import all_weights, routed_rows


def make_shard(moe_dir, **kw):
    return ExpertShard.from_model_dir(str(moe_dir), "auto", torch.device("cpu"), **kw)


def test_forward_matches_grouped_gemm_on_a_subset(moe_dir):
    cfg, weights = all_weights(moe_dir)
    layer = cfg.moe_layers[1]
    shard = make_shard(moe_dir)
    assert shard.load(layer, [6, 1, 3]) == (1, 3, 6)
    x, ids, counts = routed_rows(20, [6, 1])
    got = shard.forward(layer, x, ids.tolist(), counts.tolist())
    # logical ids index the full set; the shard holds float32 experts [in, out] (matmul_layout), which
    # the compiled CPU kernels do not read: the torch path, bit for bit
    want = grouped_expert_mlp(x, ids, counts, weights[layer], backend="torch")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    snap = shard.stats.snapshot()
    assert snap.tokens == {(layer, e): n for e, n in zip([6, 1], counts.tolist()) if n}
    assert sum(snap.tokens.values()) == 20
    assert snap.requests == 1


def test_unknown_experts_are_named(moe_dir):
    shard = make_shard(moe_dir)
    shard.load(0, [0, 1])
    x, ids, counts = routed_rows(4, [1, 5])
    with pytest.raises(UnknownExperts, match=r"layer 0: experts \[5\]"):
        shard.forward(0, x, ids.tolist(), counts.tolist())
    with pytest.raises(UnknownExperts, match="layer 1"):
        shard.forward(1, x, ids.tolist(), counts.tolist())


def test_live_load_and_drop_keep_results_exact(moe_dir):
    cfg, weights = all_weights(moe_dir)
    shard = make_shard(moe_dir)
    shard.load(0, [2])
    x, ids, counts = routed_rows(9, [2, 7])
    shard.load(0, [7])
    got = shard.forward(0, x, ids.tolist(), counts.tolist())
    at_once = make_shard(moe_dir)
    at_once.load(0, [2, 7])
    torch.testing.assert_close(got, at_once.forward(0, x, ids.tolist(), counts.tolist()), rtol=0, atol=0)  # loaded live == at once
    torch.testing.assert_close(got, grouped_expert_mlp(x, ids, counts, weights[0]))  # float32 rounding: held [in, out]
    assert shard.drop(0, [2, 4]) == (7,)
    with pytest.raises(UnknownExperts):
        shard.forward(0, x, ids.tolist(), counts.tolist())
    assert shard.drop(0, [7]) == () and shard.held() == {}


def test_a_load_reads_only_the_experts_it_adds_and_a_drop_reads_none(moe_dir, monkeypatch):
    import expert_svc.shard as shard_module

    cfg, weights = all_weights(moe_dir)
    shard = make_shard(moe_dir)
    read = []
    real = shard_module.load_expert_weights
    monkeypatch.setattr(shard_module, "load_expert_weights", lambda r, m, layer, ids, *a: read.append((layer, list(ids))) or real(r, m, layer, ids, *a))
    shard.load(0, [5, 1])
    shard.load(0, [3, 1, 7])  # 1 is held: only 3 and 7 are read
    assert shard.drop(0, [5]) == (1, 3, 7)
    shard.load(0, [0])
    assert read == [(0, [1, 5]), (0, [3, 7]), (0, [0])] and shard.experts_read == 5
    x, ids, counts = routed_rows(16, [7, 0, 3, 1])
    at_once = make_shard(moe_dir)
    at_once.load(0, [0, 1, 3, 7])
    torch.testing.assert_close(shard.forward(0, x, ids.tolist(), counts.tolist()), at_once.forward(0, x, ids.tolist(), counts.tolist()),
                               rtol=0, atol=0)
    t = x[:5]
    w = torch.rand(5, 4)
    torch.testing.assert_close(shard.forward_weighted(0, t, [0, 1, 3, 7], w), at_once.forward_weighted(0, t, [0, 1, 3, 7], w), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4", "bf16"])
def test_growing_a_quantized_layer_keeps_its_experts_exact(moe_dir, fmt):
    shard = make_shard(moe_dir, experts_dtype=fmt)
    shard.load(1, [6, 2])
    shard.load(1, [4, 0])
    shard.drop(1, [2])
    at_once = make_shard(moe_dir, experts_dtype=fmt)
    at_once.load(1, [0, 4, 6])
    x, ids, counts = routed_rows(12, [4, 0, 6])
    torch.testing.assert_close(shard.forward(1, x, ids.tolist(), counts.tolist()), at_once.forward(1, x, ids.tolist(), counts.tolist()),
                               rtol=0, atol=0)


def test_slot_budget(moe_dir):
    shard = make_shard(moe_dir, slot_budget=3)
    shard.load(0, [0, 1])
    with pytest.raises(OverBudget, match="slot_budget is 3"):
        shard.load(1, [0, 1])
    shard.load(1, [5])
    assert shard.slots_used() == 3


@pytest.mark.parametrize(
    "layer, x, ids, counts, match",
    [
        (0, torch.zeros(3, 64), [0], [2], "counts sum to 2"),
        (0, torch.zeros(3, 32), [0], [3], r"x must be \[N, 64\]"),
        (0, torch.zeros(3, 64), [0, 1], [3], "counts has 1"),
        (0, torch.zeros(3, 64), [0, 0], [1, 2], "each expert once"),
        (0, torch.zeros(3, 64), [9], [3], r"expert_ids \[9\]"),
        (0, torch.zeros(3, 64, dtype=torch.int32), [0], [3], "x.dtype"),
        (5, torch.zeros(3, 64), [0], [3], "layer 5 is not a MoE layer"),
    ],
)
def test_bad_requests_name_the_field(moe_dir, layer, x, ids, counts, match):
    shard = make_shard(moe_dir)
    shard.load(0, [0, 1])
    with pytest.raises(BadForward, match=match):
        shard.forward(layer, x, ids, counts)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4", "nvfp4"])
def test_quantized_experts_match_the_in_process_engine(moe_dir, fmt):
    from moemesh.checkpoint import CheckpointReader
    from moemesh.models.registry import load_model_config
    from moemesh.moe.local_experts import LocalExperts

    cfg = load_model_config(moe_dir)
    local = LocalExperts.from_checkpoint(CheckpointReader(moe_dir), cfg, torch.float32, fmt)
    shard = make_shard(moe_dir, experts_dtype=fmt)
    shard.load(1, [3, 4, 6])
    x, ids, counts = routed_rows(11, [6, 3])
    want = local.submit(1, x, ids, counts).result()
    torch.testing.assert_close(shard.forward(1, x, ids.tolist(), counts.tolist()), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("experts", [list(range(8)), [1, 4, 6]])
def test_forward_weighted_combines_on_the_server(moe_dir, experts):
    """Every token to every named expert, weighted and summed here: all held experts take the
    concatenated path, a subset the grouped one; both equal the weighted sum of grouped outputs."""
    shard = ExpertShard.from_model_dir(str(moe_dir), "auto", torch.device("cpu"))
    cfg, weights = all_weights(moe_dir)
    shard.load(0, range(8))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, cfg.hidden_size, generator=g)
    w = torch.softmax(torch.randn(6, len(experts), generator=g), -1)
    ids = torch.tensor(experts)
    rows = grouped_expert_mlp(x.repeat(len(experts), 1), ids, torch.full((len(experts),), 6), weights[0]).view(len(experts), 6, -1)
    want = (rows * w.t()[:, :, None]).sum(0)
    torch.testing.assert_close(shard.forward_weighted(0, x, experts, w), want, rtol=1e-5, atol=1e-5)
    assert shard.forward_weighted(0, x[:0], experts, w[:0]).shape == (0, cfg.hidden_size)
    with pytest.raises(BadForward, match="at least one expert"):
        shard.forward_weighted(0, x, [], w[:, :0])
