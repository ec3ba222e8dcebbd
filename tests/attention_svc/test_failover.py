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
from moemesh.contracts.placement import Placement
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


class Hanging(ShardTransport):
    """A server that takes calls and never answers (stopped, not gone): only its timeout would end them."""

    def forward(self, req):
        self.requests.append(req)
        return Future()


def hanging_setup(tiny_model_dir):
    cfg, weights = all_weights(tiny_model_dir)
    # every expert on both servers: a placement without "bad" needs nothing loaded
    p1 = Placement(1, {layer: (("good", "bad"),) * 8 for layer in cfg.moe_layers})
    opened, reports = {}, []

    def transport_for(peer):
        opened[peer.server_id] = (Hanging if peer.server_id == "bad" else ShardTransport)(peer, weights)
        return opened[peer.server_id]

    experts = RemoteExperts(p1, peers(["good", "bad"]), transport_for, report_failure=lambda sid, d: reports.append(sid),
                            failover_timeout_s=30)
    return cfg, weights, experts, opened, reports


def test_calls_waiting_on_a_server_declared_dead_fail_over_at_once(tiny_model_dir):
    cfg, weights, experts, opened, reports = hanging_setup(tiny_model_dir)
    x, plan = routed_plan(10, top_k=8)  # every token to every expert: each call uses one copy per expert, rotating
    futs = [experts.submit(layer, x, plan) for layer in cfg.moe_layers]
    time.sleep(0.1)
    assert opened["bad"].requests and not any(f.done() for f in futs)  # stuck on the hanging server
    started = time.monotonic()
    # what the control follower does with the update that drops the server
    experts.set_placement(Placement(2, {layer: (("good",),) * 8 for layer in cfg.moe_layers}), peers(["good"]))
    experts.servers_dead(["bad"], "declared dead by the control plane (placement v2)", 2)
    for layer, fut in zip(cfg.moe_layers, futs):
        torch.testing.assert_close(fut.result(5), plan_expected(x, plan, weights[layer]), rtol=1e-5, atol=1e-5)
    assert time.monotonic() - started < 2
    assert experts.placement.version == 2 and opened["bad"].closed
    assert reports == []  # the control plane already knows: nothing to report
    # a call on the old placement after the news never reaches the dead server
    sent = len(opened["bad"].requests)
    experts.servers_dead(["bad"], "again", 2)  # repeated news changes nothing
    torch.testing.assert_close(experts.submit(0, x, plan).result(5), plan_expected(x, plan, weights[0]), rtol=1e-5, atol=1e-5)
    assert len(opened["bad"].requests) == sent
    experts.close()


def test_adopting_a_placement_without_a_server_fails_over_its_waiting_calls(tiny_model_dir):
    cfg, weights, experts, opened, _ = hanging_setup(tiny_model_dir)
    x, plan = routed_plan(10, top_k=2)
    fut = experts.submit(0, x, plan)
    time.sleep(0.1)
    assert opened["bad"].requests and not fut.done()
    experts.set_placement(Placement(2, {layer: (("good",),) * 8 for layer in cfg.moe_layers}), peers(["good"]))
    experts.begin_step()  # adopted (e.g. by another layer's failover) while the call still waits
    torch.testing.assert_close(fut.result(5), plan_expected(x, plan, weights[0]), rtol=1e-5, atol=1e-5)
    experts.close()


def test_a_server_declared_dead_and_placed_again_gets_a_new_transport(tiny_model_dir):
    cfg, weights, experts, opened, _ = hanging_setup(tiny_model_dir)
    first_bad = opened["bad"]
    experts.set_placement(Placement(2, {layer: (("good",),) * 8 for layer in cfg.moe_layers}), peers(["good"]))
    experts.servers_dead(["bad"], "declared dead", 2)
    experts.begin_step()
    assert first_bad.closed
    # a restarted control plane gives the id to a server at the same address
    experts.set_placement(Placement(3, {layer: (("bad",),) * 8 for layer in cfg.moe_layers}), peers(["good", "bad"]))
    experts.begin_step()
    assert opened["bad"] is not first_bad and not opened["bad"].closed
    experts.close()


def test_news_of_a_death_before_the_placement_without_the_server_fails_its_calls_over_at_once(tiny_model_dir):
    """The control plane tells replicas at once, with the placement still in force (v1, which names the
    server): waiting calls leave the hung server now and take the placement without it when it comes;
    re-adopting v1 meanwhile does not bring the server back."""
    cfg, weights, experts, opened, reports = hanging_setup(tiny_model_dir)
    x, plan = routed_plan(10, top_k=8)
    futs = [experts.submit(layer, x, plan) for layer in cfg.moe_layers]
    time.sleep(0.1)
    assert opened["bad"].requests and not any(f.done() for f in futs)
    experts.servers_dead(["bad"], "declared dead by the control plane (placement v1)", 1)
    assert opened["bad"].closed
    sent = len(opened["bad"].requests)
    experts.begin_step()  # nothing newer staged: v1 stays, "bad" stays dead
    later = experts.submit(0, x, plan)  # a new call on v1 never reaches the dead server either
    time.sleep(0.2)
    assert len(opened["bad"].requests) == sent and not later.done()  # waiting for a placement without it
    experts.set_placement(Placement(2, {layer: (("good",),) * 8 for layer in cfg.moe_layers}), peers(["good"]))
    for layer, fut in zip(cfg.moe_layers, futs):
        torch.testing.assert_close(fut.result(5), plan_expected(x, plan, weights[layer]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(later.result(5), plan_expected(x, plan, weights[0]), rtol=1e-5, atol=1e-5)
    assert experts.placement.version == 2 and reports == []  # the control plane already knows: nothing to report
    experts.close()
