"""`FailoverExperts`: a layer whose expert server failed is reported, waits for a placement
without that server, adopts it and is submitted again; bounded by its timeout."""
import threading
import time

import grpc
import pytest
import torch

from attention_svc.failover_experts import FailoverExperts
from attention_svc.remote_experts import RemoteExperts
from control_svc.placement import initial_placement as round_robin_placement
from kernels import grouped_expert_mlp
from moemesh.transport.base import ExpertServerError
from tests.attention_svc.test_remote_experts import ShardTransport, peers
from tests.expert_svc.fixtures import all_weights, moe_dir, routed_rows  # noqa: F401


def setup(moe_dir, timeout_s):
    cfg, weights = all_weights(moe_dir)
    p1 = round_robin_placement(cfg.moe_layers, 8, [("good", 0), ("bad", 0)], version=1)
    remote = RemoteExperts(p1, peers(["good", "bad"]), lambda peer: ShardTransport(peer, weights, fail=peer.server_id == "bad"))
    reports = []
    experts = FailoverExperts(remote, lambda sid, detail: reports.append(sid), timeout_s)
    return cfg, weights, experts, reports


def test_failed_layer_is_retried_on_the_placement_without_the_dead_server(moe_dir):
    cfg, weights, experts, reports = setup(moe_dir, timeout_s=10)
    x, ids, counts = routed_rows(10, list(range(8)))
    fut = experts.submit(1, x, ids, counts)
    time.sleep(0.1)
    assert not fut.done() and reports == ["bad"]  # waiting for the control plane
    threading.Timer(0.1, lambda: experts.set_placement(
        round_robin_placement(cfg.moe_layers, 8, [("good", 0)], version=2), peers(["good"]))).start()
    torch.testing.assert_close(fut.result(5), grouped_expert_mlp(x, ids, counts, weights[1]))
    assert experts.placement.version == 2 and experts.retries == 1
    experts.close()


def test_a_combined_layer_is_retried_too(moe_dir):
    cfg, weights, experts, reports = setup(moe_dir, timeout_s=10)
    x, _, _ = routed_rows(6, [0])
    gates = torch.softmax(torch.randn(6, 8, generator=torch.Generator().manual_seed(2)), -1)
    fut = experts.submit_all(1, x, gates)
    time.sleep(0.1)
    assert not fut.done() and reports == ["bad"]
    experts.set_placement(round_robin_placement(cfg.moe_layers, 8, [("good", 0)], version=2), peers(["good"]))
    ids = torch.arange(8)
    rows = grouped_expert_mlp(x.repeat(8, 1), ids, torch.full((8,), 6), weights[1]).view(8, 6, -1)
    torch.testing.assert_close(fut.result(5), (rows * gates.t()[:, :, None]).sum(0), rtol=1e-5, atol=1e-5)
    assert experts.retries == 1
    experts.close()


def test_no_placement_without_the_server_ends_in_unavailable_within_the_timeout(moe_dir):
    cfg, _, experts, reports = setup(moe_dir, timeout_s=0.5)
    x, ids, counts = routed_rows(10, list(range(8)))
    # a newer placement that still names the dead server does not count
    experts.set_placement(round_robin_placement(cfg.moe_layers, 8, [("bad", 0)], version=2), peers(["bad"]))
    started = time.monotonic()
    with pytest.raises(ExpertServerError, match="no placement without this server") as e:
        experts.submit(0, x, ids, counts).result(5)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 2
    assert reports and set(reports) == {"bad"}
    experts.close()


def test_bad_requests_are_not_retried(moe_dir):
    _, weights, experts, reports = setup(moe_dir, timeout_s=10)

    class Refusing(ShardTransport):
        def forward(self, layer, x, expert_ids, counts, placement_version=0):
            fut = super().forward(layer, x, expert_ids, counts, placement_version)
            fut = type(fut)()
            fut.set_exception(ExpertServerError(self.server_id, "127.0.0.1:1", "INVALID_ARGUMENT: x", grpc.StatusCode.INVALID_ARGUMENT))
            return fut

    experts.inner.transport_for = lambda peer: Refusing(peer, weights)
    experts.set_placement(round_robin_placement((0, 1), 8, [("other", 0)], version=2), peers(["other"]))
    experts.begin_step()
    x, ids, counts = routed_rows(4, [0, 1])
    with pytest.raises(ExpertServerError, match="INVALID_ARGUMENT"):
        experts.submit(0, x, ids, counts).result(5)
    assert reports == []
    experts.close()
