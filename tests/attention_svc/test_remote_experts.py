"""`RemoteExperts`: the per-server split of a layer's plan, the partial-sum combine, placement
adoption at step boundaries, and the whole path over real expert servers (gRPC and dist)."""
import dataclasses
import functools
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import Future
from pathlib import Path

import grpc
import pytest
import torch

from attention_svc.expert_split import LayerCopies, ServerPart, partial_sum, split_plan
from attention_svc.remote_experts import RemoteExperts
from control_svc.placement import initial_placement as round_robin_placement
from moemesh.contracts.info import ServerInfo
from moemesh.contracts.placement import Placement
from moemesh.errors import MeshError
from moemesh.moe.dispatch import DispatchPlan, make_plan
from moemesh.moe.gate import Routing, softmax_topk
from moemesh.moe.layer_experts import LayerExperts
from moemesh.moe.local_experts import LocalExperts
from moemesh.transport.dist_link import host_id
from moemesh.transport.dist_transport import DistTransport, open_transport
from moemesh.transport.grpc_transport import GrpcTransport
from tests.fixtures.auth import TEST_RPC, token_env
from tests.fixtures.expert_servers import (  # noqa: F401
    all_weights, expected, loop, plan_expected, routed_plan, routed_request, running_expert_servers,
)

REPO = Path(__file__).resolve().parents[2]


def plan_of(ids, weights=None, num_experts=4):
    ids = torch.tensor(ids)
    w = torch.rand(ids.shape) if weights is None else torch.tensor(weights)
    return make_plan(Routing(ids, w), num_experts)


def rows_of(plan: DispatchPlan, parts: list[ServerPart]) -> set[tuple[int, int, float]]:
    """(token, expert, weight) of every row, from the plan or from the servers' parts."""
    out = []
    for p in parts:
        tokens = torch.arange(10_000) if p.tokens is None else p.tokens
        experts = torch.repeat_interleave(p.expert_ids, p.counts)
        out += list(zip(tokens[p.token_idx.long()].tolist(), experts.tolist(), p.weights.tolist()))
    return out


def plan_rows(plan: DispatchPlan):
    plan = plan.with_rows()
    experts = torch.repeat_interleave(plan.expert_ids, plan.counts)
    return list(zip(plan.token_idx.tolist(), experts.tolist(), plan.weights.tolist()))


def test_split_sends_each_token_a_server_needs_once():
    # top-2 of 4 experts; experts 0, 1 on "a", 2, 3 on "b": token 0 (experts 0, 1) only reaches "a", once
    plan = plan_of([[0, 1], [1, 2], [3, 2], [0, 3]])
    parts = split_plan(plan, LayerCopies.of([("a",), ("a",), ("b",), ("b",)]), num_tokens=4)
    assert [p.server_id for p in parts] == ["a", "b"]
    a, b = parts
    assert a.tokens.tolist() == [0, 1, 3] and b.tokens.tolist() == [1, 2, 3]  # each token once, ascending
    assert a.expert_ids.tolist() == [0, 1] and a.counts.tolist() == [2, 2]
    assert a.token_idx.dtype == torch.int32 and a.weights.dtype == torch.float32
    assert sorted(rows_of(plan, parts)) == sorted(plan_rows(plan))


def test_split_over_replicas_covers_every_row_once_and_rotates_the_first_copy():
    plan = plan_of([[0, 1, 2]] * 3 + [[1, 2, 3]] * 4, num_experts=4)  # expert 0: 3 rows, 1: 7, 2: 7, 3: 4
    copies = [("a",), ("a", "b"), ("b", "c", "a"), ("c",)]
    parts = split_plan(plan, LayerCopies.of(copies), num_tokens=7)
    assert sorted(rows_of(plan, parts)) == sorted(plan_rows(plan))
    per = {p.server_id: dict(zip(p.expert_ids.tolist(), p.counts.tolist())) for p in parts}
    # expert e's first chunk goes to copy e % r: expert 1 -> b gets the extra row, expert 2 -> a does
    assert per == {"a": {0: 3, 1: 3, 2: 3}, "b": {1: 4, 2: 2}, "c": {2: 2, 3: 4}}


def test_split_of_an_all_experts_plan_computes_each_expert_whole_on_one_copy_rotating():
    t, e = 5, 4
    plan = make_plan(softmax_topk(torch.randn(t, e), e, True), e)
    copies = LayerCopies.of([("a", "b")] * e)
    chosen = []
    for rotation in range(2):
        parts = split_plan(plan, copies, t, rotation)
        assert sorted(rows_of(plan, parts)) == sorted(plan_rows(plan))
        assert all(p.tokens is None and p.counts.tolist() == [t] * len(p.counts) for p in parts)
        for p in parts:  # every token to every expert it computes, in token order
            assert p.token_idx.tolist() == list(range(t)) * len(p.counts)
        chosen.append({p.server_id: p.expert_ids.tolist() for p in parts})
    assert chosen == [{"a": [0, 2], "b": [1, 3]}, {"a": [1, 3], "b": [0, 2]}]


def test_split_of_an_all_experts_plan_equals_the_split_of_its_rows():
    # one copy per expert: the plan's weights by expert give each server the parts its rows would
    t, e = 6, 4
    plan = make_plan(softmax_topk(torch.randn(t, e), e, True), e)
    rows = dataclasses.replace(plan.with_rows(), by_expert=None)
    copies = LayerCopies.of([("b",), ("a",), ("b",), ("b",)])
    got, want = split_plan(plan, copies, t), split_plan(rows, copies, t)
    assert [p.server_id for p in got] == [p.server_id for p in want] == ["a", "b"]
    for g, w in zip(got, want):
        assert g.tokens is None and w.tokens is None
        for name in ("token_idx", "weights", "expert_ids", "counts"):
            assert getattr(g, name).dtype == getattr(w, name).dtype and torch.equal(getattr(g, name), getattr(w, name)), name
    with pytest.raises(ValueError, match="expert_ids"):
        split_plan(plan, LayerCopies.of([("a",)] * 3), t)


def test_partial_sum_adds_in_server_order_in_float32():
    x = torch.zeros(4, 3, dtype=torch.bfloat16)
    parts = [ServerPart(s, tok, torch.empty(0), torch.empty(0), torch.empty(0), torch.empty(0))
             for s, tok in (("a", None), ("b", torch.tensor([1, 3])))]
    partials = {"b": torch.ones(2, 3, dtype=torch.bfloat16) * 1e-3, "a": torch.full((4, 3), 256.0, dtype=torch.bfloat16)}
    y = partial_sum(x, parts, partials)
    assert y.dtype == torch.bfloat16
    want = torch.full((4, 3), 256.0)
    want[[1, 3]] += 1e-3
    assert torch.equal(y, want.to(torch.bfloat16))


class ShardTransport:
    """An in-process transport computing each request with the oracle weights (logic-only tests)."""

    def __init__(self, peer, weights, fail=False):
        self.server_id = peer.server_id
        self.weights = weights
        self.fail = fail
        self.closed = False
        self.requests = []

    def forward(self, req):
        self.requests.append(req)
        fut = Future()
        if self.fail:
            fut.set_exception(MeshError(grpc.StatusCode.UNAVAILABLE, "gone", server_id=self.server_id, address="127.0.0.1:1"))
        else:
            fut.set_result(expected(req, self.weights[req.layer]))
        return fut

    def close(self):
        self.closed = True


def peers(ids):
    return {s: ServerInfo(s, f"127.0.0.1:{i + 1}") for i, s in enumerate(ids)}


def test_remote_equals_moe_mlp_and_each_server_gets_its_tokens_once(tiny_model_dir):
    cfg, weights = all_weights(tiny_model_dir)
    opened = {}

    def transport_for(peer):
        opened[peer.server_id] = ShardTransport(peer, weights)
        return opened[peer.server_id]

    placement = Placement(1, {layer: tuple((("a",) if e < 4 else ("b",)) for e in range(8)) for layer in cfg.moe_layers})
    remote = RemoteExperts(placement, peers("ab"), transport_for)
    x, plan = routed_plan(12, top_k=4, seed=3)
    torch.testing.assert_close(remote.submit(0, x, plan).result(), plan_expected(x, plan, weights[0]))
    for t in opened.values():
        (req,) = t.requests
        tokens = req.x.shape[0]
        assert tokens <= 12 and req.token_idx.numel() >= tokens  # each token it needs once, however many of its experts
        assert sorted(set(req.token_idx.tolist())) == list(range(tokens))


def test_placement_is_adopted_at_step_boundaries_only(tiny_model_dir):
    cfg, weights = all_weights(tiny_model_dir)
    opened = {}

    def transport_for(peer):
        opened[peer.server_id] = ShardTransport(peer, weights)
        return opened[peer.server_id]

    p1 = round_robin_placement(cfg.moe_layers, 8, [("a", 0), ("b", 0)], version=1)
    p2 = round_robin_placement(cfg.moe_layers, 8, [("c", 0)], version=2)
    remote = RemoteExperts(p1, peers("ab"), transport_for)
    x, plan = routed_plan(12, top_k=8)
    remote.submit(0, x, plan).result()
    remote.set_placement(p2, peers("abc"))
    y = remote.submit(1, x, plan).result()  # same step: still v1
    assert [r.placement_version for r in opened["a"].requests] == [1, 1] and "c" not in opened
    torch.testing.assert_close(y, plan_expected(x, plan, weights[1]))
    remote.submit(0, x, plan).result()  # layer went down: new step, v2
    assert [r.placement_version for r in opened["c"].requests] == [2] and opened["a"].closed and remote.adopted_version == 2
    remote.set_placement(p1, peers("ab"))  # older version: ignored
    assert remote.begin_step() == 2


def test_server_failure_names_the_server_and_the_layer_can_be_retried(tiny_model_dir):
    cfg, weights = all_weights(tiny_model_dir)
    p1 = round_robin_placement(cfg.moe_layers, 8, [("good", 0), ("bad", 0)], version=1)
    remote = RemoteExperts(p1, peers(["good", "bad"]), lambda peer: ShardTransport(peer, weights, fail=peer.server_id == "bad"))
    x, plan = routed_plan(10, top_k=8)
    with pytest.raises(MeshError, match="expert server bad") as e:
        remote.submit(0, x, plan).result()
    assert e.value.server_id == "bad" and e.value.code == grpc.StatusCode.UNAVAILABLE
    remote.set_placement(round_robin_placement(cfg.moe_layers, 8, [("good", 0)], version=2), peers(["good"]))
    remote.begin_step()
    torch.testing.assert_close(remote.submit(0, x, plan).result(), plan_expected(x, plan, weights[0]))


def server_infos(parts_list):
    return {f"s{i}": ServerInfo(f"s{i}", p.address, host_id=p.dist.host_id if p.dist else "", dist_addr=p.dist.addr if p.dist else "") for i, p in enumerate(parts_list)}


def check_equals_local(remote, cfg, weights):
    local = LocalExperts({layer: LayerExperts.hold(range(8), w) for layer, w in weights.items()})
    for step in range(2):
        for layer in cfg.moe_layers:
            for top_k in (2, 8):  # sparse, and every token to every expert (combined side by side)
                x, plan = routed_plan(40 if top_k == 2 else 9, top_k=top_k, seed=10 * step + layer)
                with torch.inference_mode():  # as the engine calls it
                    got = remote.submit(layer, x, plan).result(30)
                # partial sums grouped by server: equal up to float32 rounding
                torch.testing.assert_close(got, local.submit(layer, x, plan), rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(got, plan_expected(x, plan, weights[layer]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transport", ["grpc", "dist"])
@pytest.mark.parametrize("n_servers", [1, 2, 3])
def test_remote_equals_local_over_real_servers(tiny_model_dir, loop, transport, n_servers):
    cfg, weights = all_weights(tiny_model_dir)
    with running_expert_servers(tiny_model_dir, n_servers, loop, preload="all", transport="grpc" if transport == "grpc" else "dist") as parts:
        infos = server_infos(parts)
        ids = sorted(infos)
        # one copy each, plus (with 2+ servers) every expert of layer 1 replicated on two servers
        placement = round_robin_placement(cfg.moe_layers, 8, [(s, 0) for s in ids], version=1)
        if n_servers > 1:
            placement = Placement(1, {**placement.replicas, 1: tuple((ids[e % n_servers], ids[(e + 1) % n_servers]) for e in range(8))})
        transport_for = functools.partial(open_transport, mode=transport, rpc=TEST_RPC, timeout_s=20)
        remote = RemoteExperts(placement, infos, transport_for)
        try:
            kinds = {type(t).__name__ for _, t in remote._transports.values()}
            assert kinds == {"GrpcTransport" if transport == "grpc" else "DistTransport"}
            check_equals_local(remote, cfg, weights)
        finally:
            remote.close()


def test_unknown_expert_on_a_server_surfaces_as_failed_precondition(tiny_model_dir, loop):
    with running_expert_servers(tiny_model_dir, 1, loop, transport="dist") as (srv,):
        srv.shard.load(0, [0])
        info = ServerInfo("only", srv.address, host_id=srv.dist.host_id, dist_addr=srv.dist.addr)
        req = routed_request(6, [0, 4])
        for make in (GrpcTransport, DistTransport):
            t = make(info, TEST_RPC, timeout_s=20)
            try:
                with pytest.raises(MeshError, match=r"expert server only .*experts \[4\]") as e:
                    t.forward(req).result(30)
                assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
            finally:
                t.close()


def test_auto_picks_dist_only_on_this_node(loop):
    here = ServerInfo("a", "127.0.0.1:1", host_id=host_id(), dist_addr="127.0.0.1:2")
    elsewhere = ServerInfo("b", "10.0.0.9:1", host_id="other/boot", dist_addr="10.0.0.9:2")
    no_dist = ServerInfo("c", "127.0.0.1:3", host_id=host_id())
    cuda_peer = ServerInfo("d", "127.0.0.1:4", device="cuda:0", host_id=host_id(), dist_addr="127.0.0.1:5")
    want = DistTransport if torch.cuda.is_available() else GrpcTransport
    assert isinstance(open_transport(cuda_peer, "auto", TEST_RPC), want)
    assert isinstance(open_transport(here, "auto", TEST_RPC), DistTransport)
    assert isinstance(open_transport(elsewhere, "auto", TEST_RPC), GrpcTransport)
    assert isinstance(open_transport(no_dist, "auto", TEST_RPC), GrpcTransport)
    with pytest.raises(ValueError, match="another node"):
        open_transport(elsewhere, "dist", TEST_RPC)
    with pytest.raises(ValueError, match="transport must be"):
        open_transport(here, "smoke", TEST_RPC)


def start_server_process(tiny_model_dir):
    env = dict(token_env(), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "expert_svc", "--model-dir", str(tiny_model_dir), "--preload", "all", "--transport", "dist"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    line = proc.stdout.readline()  # "moemesh expert_svc: serving HOST:PORT dist=HOST:PORT"
    if not line.startswith("moemesh expert_svc: serving"):
        proc.kill()
        proc.wait()
        raise AssertionError(f"expert server did not start: {line!r}")
    words = line.split()
    return proc, words[3], words[4].removeprefix("dist=")


@pytest.mark.slow  # expert servers as processes
def test_dist_transport_across_processes(tiny_model_dir, loop):
    """Two expert server processes on loopback, tensors over gloo pair groups."""
    cfg, weights = all_weights(tiny_model_dir)
    procs = []
    try:
        for _ in range(2):
            procs.append(start_server_process(tiny_model_dir))
        infos = {f"s{i}": ServerInfo(f"s{i}", addr, host_id=host_id(), dist_addr=dist) for i, (_, addr, dist) in enumerate(procs)}
        placement = round_robin_placement(cfg.moe_layers, 8, [(s, 0) for s in sorted(infos)], version=1)
        remote = RemoteExperts(placement, infos, lambda peer: DistTransport(peer, TEST_RPC, timeout_s=20))
        try:
            check_equals_local(remote, cfg, weights)
        finally:
            remote.close()
    finally:
        for proc, *_ in procs:
            proc.send_signal(signal.SIGTERM)
        for proc, *_ in procs:
            try:
                assert proc.wait(20) == 0
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise


@pytest.mark.slow  # an expert server as a process
def test_dist_link_to_a_killed_server_fails_fast(tiny_model_dir, loop):
    """SIGKILL while the link is idle: the next call fails UNAVAILABLE (failover's cue), not after a
    timeout, and so does the one after it (which tries to open a new link)."""
    cfg, weights = all_weights(tiny_model_dir)
    proc, addr, dist = start_server_process(tiny_model_dir)
    t = DistTransport(ServerInfo("s0", addr, host_id=host_id(), dist_addr=dist), TEST_RPC, timeout_s=20)
    try:
        req = routed_request(8, [1, 6], layer=1)
        torch.testing.assert_close(t.forward(req).result(30), expected(req, weights[1]))
        proc.kill()
        proc.wait()
        start = time.monotonic()
        for _ in range(2):
            with pytest.raises(MeshError) as e:
                t.forward(req).result(30)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE, e.value
        assert time.monotonic() - start < 10
    finally:
        t.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("make", [GrpcTransport, DistTransport])
def test_bf16_travels_bit_exactly(tiny_model_dir, loop, make):
    """A bf16 request and its answer cross either transport unchanged: what the caller gets is what
    the server computed (here: the shard itself, called in process)."""
    with running_expert_servers(tiny_model_dir, 1, loop, transport="dist", preload="all") as (srv,):
        info = ServerInfo("only", srv.address, host_id=srv.dist.host_id, dist_addr=srv.dist.addr)
        req = routed_request(9, [1, 6], layer=1, dtype=torch.bfloat16)
        t = make(info, TEST_RPC, timeout_s=20)
        try:
            y = t.forward(req).result(30)
        finally:
            t.close()
        assert y.dtype == torch.bfloat16
        assert torch.equal(y.view(torch.int16), srv.shard.forward(req).view(torch.int16))
