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

from attention_svc.remote_experts import RemoteExperts, plan_requests
from control_svc.placement import initial_placement as round_robin_placement
from kernels import grouped_expert_mlp
from moemesh.contracts.info import ServerInfo
from moemesh.contracts.placement import Placement
from moemesh.moe.local_experts import LocalExperts
from moemesh.rpc.config import RpcConfig
from moemesh.transport.base import ExpertServerError
from moemesh.transport.dist_link import host_id
from moemesh.transport.dist_transport import DistTransport, open_transport
from moemesh.transport.grpc_transport import GrpcTransport
from tests.expert_svc.fixtures import all_weights, loop, moe_dir, routed_rows, running_expert_servers  # noqa: F401
from tests.fixtures.auth import TEST_RPC, token_env

REPO = Path(__file__).resolve().parents[2]


def test_plan_covers_every_row_once_and_spreads_replicas():
    p = Placement(1, {0: (("a",), ("a", "b"), ("b", "c", "a"))})
    ids, counts = torch.tensor([0, 1, 2]), torch.tensor([3, 5, 7])
    reqs = plan_requests(p, 0, ids, counts)
    assert torch.equal(torch.sort(torch.cat([r.index for r in reqs])).values, torch.arange(15))
    rows = {r.server_id: dict(zip(r.expert_ids.tolist(), r.counts.tolist())) for r in reqs}
    # expert e starts at replica e % r: expert 1 -> b gets the extra row, expert 2 -> a does
    assert rows == {"a": {0: 3, 1: 2, 2: 3}, "b": {1: 3, 2: 2}, "c": {2: 2}}
    with pytest.raises(KeyError, match="layer 4"):
        plan_requests(p, 4, ids, counts)


class ShardTransport:
    """An in-process transport over a subset of the oracle weights (for logic-only tests)."""

    def __init__(self, peer, weights, fail=False):
        self.server_id = peer.server_id
        self.weights = weights
        self.fail = fail
        self.closed = False
        self.versions = []

    def forward(self, layer, x, expert_ids, counts, placement_version=0, weights=None):
        self.versions.append(placement_version)
        fut = Future()
        if self.fail:
            fut.set_exception(ExpertServerError(self.server_id, "127.0.0.1:1", "UNAVAILABLE: gone"))
        elif weights is None:
            fut.set_result(grouped_expert_mlp(x, expert_ids, counts, self.weights[layer]))
        else:  # combined here, as a server does
            g, t = len(expert_ids), x.shape[0]
            rows = grouped_expert_mlp(x.repeat(g, 1), expert_ids, torch.full((g,), t), self.weights[layer]).view(g, t, -1)
            fut.set_result((rows * weights.t()[:, :, None]).sum(0))
        return fut

    def close(self):
        self.closed = True


def peers(ids):
    return {s: ServerInfo(s, f"127.0.0.1:{i + 1}") for i, s in enumerate(ids)}


def test_placement_is_adopted_at_step_boundaries_only(moe_dir):
    cfg, weights = all_weights(moe_dir)
    opened = {}

    def transport_for(peer):
        opened[peer.server_id] = ShardTransport(peer, weights)
        return opened[peer.server_id]

    p1 = round_robin_placement(cfg.moe_layers, 8, [("a", 0), ("b", 0)], version=1)
    p2 = round_robin_placement(cfg.moe_layers, 8, [("c", 0)], version=2)
    remote = RemoteExperts(p1, peers("ab"), transport_for)
    x, ids, counts = routed_rows(12, list(range(8)))
    remote.submit(0, x, ids, counts).result()
    remote.set_placement(p2, peers("abc"))
    y = remote.submit(1, x, ids, counts).result()  # same step: still v1
    assert opened["a"].versions == [1, 1] and "c" not in opened
    torch.testing.assert_close(y, grouped_expert_mlp(x, ids, counts, weights[1]))
    remote.submit(0, x, ids, counts).result()  # layer went down: new step, v2
    assert opened["c"].versions == [2] and opened["a"].closed and remote.adopted_version == 2
    remote.set_placement(p1, peers("ab"))  # older version: ignored
    assert remote.begin_step() == 2


def test_server_failure_names_the_server_and_the_layer_can_be_retried(moe_dir):
    cfg, weights = all_weights(moe_dir)
    p1 = round_robin_placement(cfg.moe_layers, 8, [("good", 0), ("bad", 0)], version=1)
    remote = RemoteExperts(p1, peers(["good", "bad"]), lambda peer: ShardTransport(peer, weights, fail=peer.server_id == "bad"))
    x, ids, counts = routed_rows(10, list(range(8)))
    with pytest.raises(ExpertServerError, match="expert server bad"):
        remote.submit(0, x, ids, counts).result()
    with pytest.raises(ExpertServerError, match="expert server bad"):
        remote.submit_all(0, x, torch.softmax(torch.randn(10, 8), -1)).result()
    with pytest.raises(ValueError, match="weights"):
        remote.submit_all(0, x, torch.rand(10, 7))
    with pytest.raises(ValueError, match="counts"):
        remote.submit(0, x, ids, counts + 1)
    remote.set_placement(round_robin_placement(cfg.moe_layers, 8, [("good", 0)], version=2), peers(["good"]))
    remote.begin_step()
    torch.testing.assert_close(remote.submit(0, x, ids, counts).result(), grouped_expert_mlp(x, ids, counts, weights[0]))


def server_infos(parts_list):
    return {f"s{i}": ServerInfo(f"s{i}", p.address, host_id=p.dist.host_id if p.dist else "", dist_addr=p.dist.addr if p.dist else "") for i, p in enumerate(parts_list)}


def check_equals_local(remote, moe_dir, cfg, weights):
    local = LocalExperts(weights)
    for step in range(2):
        for layer in cfg.moe_layers:
            x, ids, counts = routed_rows(40, [0, 2, 3, 5, 6, 7], seed=10 * step + layer)
            with torch.inference_mode():  # as the engine calls it
                fut = remote.submit(layer, x, ids, counts)
            got = fut.result(30)
            assert got.is_inference()
            # rows split over replicas change GEMM blocking: equal up to float32 rounding
            torch.testing.assert_close(got, local.submit(layer, x, ids, counts).result(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got, grouped_expert_mlp(x, ids, counts, weights[layer]), rtol=1e-5, atol=1e-6)
            # every token to every expert, combined on the servers: equals the in-process combine
            t = torch.randn(9, x.shape[1], generator=torch.Generator().manual_seed(step))
            gates = torch.softmax(torch.randn(9, 8, generator=torch.Generator().manual_seed(layer)), -1)
            with torch.inference_mode():
                combined = remote.submit_all(layer, t, gates).result(30)
            torch.testing.assert_close(combined, local.submit_all(layer, t, gates).result(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transport", ["grpc", "dist"])
@pytest.mark.parametrize("n_servers", [1, 2, 3])
def test_remote_equals_local_over_real_servers(moe_dir, loop, transport, n_servers):
    cfg, weights = all_weights(moe_dir)
    with running_expert_servers(moe_dir, n_servers, loop, preload="all", transport="grpc" if transport == "grpc" else "dist") as parts:
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
            check_equals_local(remote, moe_dir, cfg, weights)
        finally:
            remote.close()


def test_unknown_expert_on_a_server_surfaces_as_failed_precondition(moe_dir, loop):
    with running_expert_servers(moe_dir, 1, loop, transport="dist") as (srv,):
        srv.shard.load(0, [0])
        info = ServerInfo("only", srv.address, host_id=srv.dist.host_id, dist_addr=srv.dist.addr)
        x, ids, counts = routed_rows(6, [0, 4])
        for make in (GrpcTransport, DistTransport):
            t = make(info, TEST_RPC, timeout_s=20)
            try:
                with pytest.raises(ExpertServerError, match=r"expert server only .*FAILED_PRECONDITION.*experts \[4\]"):
                    t.forward(0, x, ids, counts).result(30)
            finally:
                t.close()


def test_auto_picks_dist_only_on_this_node(loop):
    here = ServerInfo("a", "127.0.0.1:1", host_id=host_id(), dist_addr="127.0.0.1:2")
    elsewhere = ServerInfo("b", "10.0.0.9:1", host_id="other/boot", dist_addr="10.0.0.9:2")
    no_dist = ServerInfo("c", "127.0.0.1:3", host_id=host_id())
    cuda_peer = ServerInfo("d", "127.0.0.1:4", device="cuda:0", host_id=host_id(), dist_addr="127.0.0.1:5")
    want = DistTransport if torch.cuda.is_available() else GrpcTransport
    assert isinstance(open_transport(cuda_peer, "auto", RpcConfig()), want)
    assert isinstance(open_transport(here, "auto", RpcConfig()), DistTransport)
    assert isinstance(open_transport(elsewhere, "auto", RpcConfig()), GrpcTransport)
    assert isinstance(open_transport(no_dist, "auto", RpcConfig()), GrpcTransport)
    with pytest.raises(ValueError, match="another node"):
        open_transport(elsewhere, "dist", RpcConfig())
    with pytest.raises(ValueError, match="transport must be"):
        open_transport(here, "smoke", RpcConfig())


def start_server_process(moe_dir):
    env = dict(token_env(), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "expert_svc", "--model-dir", str(moe_dir), "--preload", "all", "--transport", "dist"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    line = proc.stdout.readline()  # "moemesh expert_svc: serving HOST:PORT dist=HOST:PORT"
    if not line.startswith("moemesh expert_svc: serving"):
        proc.kill()
        proc.wait()
        raise AssertionError(f"expert server did not start: {line!r}")
    words = line.split()
    return proc, words[3], words[4].removeprefix("dist=")


def test_dist_transport_across_processes(moe_dir, loop):
    """Two expert server processes on loopback, tensors over gloo pair groups."""
    cfg, weights = all_weights(moe_dir)
    procs = []
    try:
        for _ in range(2):
            procs.append(start_server_process(moe_dir))
        infos = {f"s{i}": ServerInfo(f"s{i}", addr, host_id=host_id(), dist_addr=dist) for i, (_, addr, dist) in enumerate(procs)}
        placement = round_robin_placement(cfg.moe_layers, 8, [(s, 0) for s in sorted(infos)], version=1)
        remote = RemoteExperts(placement, infos, lambda peer: DistTransport(peer, TEST_RPC, timeout_s=20))
        try:
            check_equals_local(remote, moe_dir, cfg, weights)
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


def test_dist_link_to_a_killed_server_fails_fast(moe_dir, loop):
    """SIGKILL while the link is idle: the next call fails UNAVAILABLE (failover's cue), not after a
    timeout, and so does the one after it (which tries to open a new link)."""
    cfg, weights = all_weights(moe_dir)
    proc, addr, dist = start_server_process(moe_dir)
    t = DistTransport(ServerInfo("s0", addr, host_id=host_id(), dist_addr=dist), TEST_RPC, timeout_s=20)
    try:
        x, ids, counts = routed_rows(8, [1, 6])
        torch.testing.assert_close(t.forward(1, x, ids, counts).result(30), grouped_expert_mlp(x, ids, counts, weights[1]))
        proc.kill()
        proc.wait()
        start = time.monotonic()
        for _ in range(2):
            with pytest.raises(ExpertServerError) as e:
                t.forward(1, x, ids, counts).result(30)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE, e.value
        assert time.monotonic() - start < 10
    finally:
        t.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("make", [GrpcTransport, DistTransport])
def test_bf16_rows_travel_bit_exactly(moe_dir, loop, make):
    cfg, weights = all_weights(moe_dir)
    with running_expert_servers(moe_dir, 1, loop, transport="dist", preload="all") as (srv,):
        info = ServerInfo("only", srv.address, host_id=srv.dist.host_id, dist_addr=srv.dist.addr)
        x, ids, counts = routed_rows(9, [1, 6])
        x = x.to(torch.bfloat16)
        t = make(info, TEST_RPC, timeout_s=20)
        try:
            y = t.forward(1, x, ids, counts).result(30)
        finally:
            t.close()
        assert y.dtype == torch.bfloat16
        # the server computes in float32, over experts held [in, out] (matmul_layout), which the compiled
        # CPU kernels do not read: the torch path, bit for bit
        want = grouped_expert_mlp(x.float(), ids, counts, weights[1], backend="torch").to(torch.bfloat16)
        assert torch.equal(y.view(torch.int16), want.view(torch.int16))
