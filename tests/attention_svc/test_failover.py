"""`RemoteExperts` failover: a layer whose expert server failed is reported, waits for a placement
without that server, adopts it and is computed again; bounded by its timeout."""
import threading
import time
from concurrent.futures import Future

import grpc
import pytest
import torch

from attention_svc.remote_experts import RemoteExperts
from control_svc.placement import initial_placement as round_robin_placement
from moemesh.errors import MeshError
from tests.attention_svc.test_remote_experts import ShardTransport, peers
from tests.fixtures.expert_servers import all_weights, plan_expected, routed_plan  # noqa: F401


def setup(tiny_model_dir, timeout_s):
    cfg, weights = all_weights(tiny_model_dir)
    p1 = round_robin_placement(cfg.moe_layers, 8, [("good", 0), ("bad", 0)], version=1)
    reports = []
    experts = RemoteExperts(
        p1, peers(["good", "bad"]), lambda peer: ShardTransport(peer, weights, fail=peer.server_id == "bad"),
        report_failure=lambda sid, detail: reports.append(sid), failover_timeout_s=timeout_s,
    )
    return cfg, weights, experts, reports


@pytest.mark.parametrize("top_k", [2, 8])  # sparse, and every token to every expert
def test_failed_layer_is_retried_on_the_placement_without_the_dead_server(tiny_model_dir, top_k):
    cfg, weights, experts, reports = setup(tiny_model_dir, timeout_s=10)
    x, plan = routed_plan(10, top_k=top_k)
    fut = experts.submit(1, x, plan)
    time.sleep(0.1)
    assert not fut.done() and reports == ["bad"]  # waiting for the control plane
    threading.Timer(0.1, lambda: experts.set_placement(
        round_robin_placement(cfg.moe_layers, 8, [("good", 0)], version=2), peers(["good"]))).start()
    torch.testing.assert_close(fut.result(5), plan_expected(x, plan, weights[1]), rtol=1e-5, atol=1e-5)
    assert experts.placement.version == 2
    experts.close()


def test_no_placement_without_the_server_ends_in_unavailable_within_the_timeout(tiny_model_dir):
    cfg, _, experts, reports = setup(tiny_model_dir, timeout_s=0.5)
    x, plan = routed_plan(10, top_k=8)
    # a newer placement that still names the dead server does not count
    experts.set_placement(round_robin_placement(cfg.moe_layers, 8, [("bad", 0)], version=2), peers(["bad"]))
    started = time.monotonic()
    with pytest.raises(MeshError, match="no placement without this server") as e:
        experts.submit(0, x, plan).result(5)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.server_id == "bad" and time.monotonic() - started < 2
    assert reports and set(reports) == {"bad"}
    experts.close()


def test_without_a_failover_timeout_the_failure_surfaces_at_once(tiny_model_dir):
    _, _, experts, reports = setup(tiny_model_dir, timeout_s=0)
    x, plan = routed_plan(4, top_k=8)
    with pytest.raises(MeshError, match="gone"):
        experts.submit(0, x, plan).result(5)
    assert reports == []
    experts.close()


def test_bad_requests_are_not_retried(tiny_model_dir):
    _, weights, experts, reports = setup(tiny_model_dir, timeout_s=10)

    class Refusing(ShardTransport):
        def forward(self, req):
            fut = Future()
            fut.set_exception(MeshError(grpc.StatusCode.INVALID_ARGUMENT, "x: bad", server_id=self.server_id))
            return fut

    experts.transport_for = lambda peer: Refusing(peer, weights)
    experts.set_placement(round_robin_placement((0, 1), 8, [("other", 0)], version=2), peers(["other"]))
    experts.begin_step()
    x, plan = routed_plan(4, top_k=2)
    with pytest.raises(MeshError, match="x: bad") as e:
        experts.submit(0, x, plan).result(5)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and reports == []
    experts.close()
