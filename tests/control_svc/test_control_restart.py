"""A control plane restarted under a running mesh (in process: control plane, two expert servers,
an attention replica's follower and RemoteExperts): the servers and the replica register again,
the new control plane rebuilds the placement they run under a higher version and the replica adopts
it; failover works afterwards."""
import functools
import time

import torch

from attention_svc.control_follower import ControlFollower
from attention_svc.remote_experts import RemoteExperts
from control_svc.config import ControlConfig
from control_svc.server import create_server
from moemesh.contracts.placement import Placement
from moemesh.transport.dist_transport import open_transport
from tests.fixtures.expert_servers import all_weights, plan_expected, routed_plan, running_expert_servers
from tests.fixtures.auth import TEST_RPC


def start_control(tiny_model_dir, loop, port=0):
    cfg = ControlConfig(model_dir=str(tiny_model_dir), port=port, expected_expert_servers=2, heartbeat_interval_s=0.1, dead_after_s=1.0,
                        release_timeout_s=2.0, rpc=TEST_RPC)
    control, _ = loop.run(create_server(cfg), 30)
    loop.run(control.start(), 30)
    return control


def wait(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_restarted_control_plane_rebuilds_the_placement_and_fails_over(tiny_model_dir, loop):
    cfg, weights = all_weights(tiny_model_dir)
    control = start_control(tiny_model_dir, loop)
    port = control.port
    try:
        with running_expert_servers(tiny_model_dir, 2, loop, transport="grpc", control_addr=control.address) as experts:
            ids = [p.agent.server_id for p in experts]

            async def attention():
                follower = ControlFollower(control.address, TEST_RPC)
                placement, servers = await follower.first_placement(20)
                remote = RemoteExperts(placement, servers, functools.partial(open_transport, mode="grpc", rpc=TEST_RPC),
                                       follower.report_failure, failover_timeout_s=20)
                await follower.start(remote, "127.0.0.1:9")
                return follower, remote

            follower, remote = loop.run(attention(), 30)
            both = Placement(2, {layer: (tuple(ids),) * 8 for layer in cfg.moe_layers})  # every expert on both servers
            loop.run(control.plane.switch.switch(both), 30)
            wait(lambda: (follower.begin_step(), remote.placement.version)[1] == 2, 10, "the replica adopts v2")
            x, plan = routed_plan(16, top_k=2)

            def step():
                follower.begin_step()
                for layer in cfg.moe_layers:
                    torch.testing.assert_close(remote.submit(layer, x, plan).result(30), plan_expected(x, plan, weights[layer]),
                                               rtol=1e-5, atol=1e-5)

            step()
            loop.run(control.shutdown(0.1), 30)
            control = start_control(tiny_model_dir, loop, port)  # a new process would know nothing either
            step()  # the replica keeps running on what it has meanwhile

            wait(lambda: control.plane.board.version >= 3, 30, "the restarted control plane commits a placement")
            rebuilt = control.plane.board.current.placement
            assert rebuilt.replicas == both.replicas  # the servers kept their ids and their experts
            assert [p.agent.server_id for p in experts] == ids
            wait(lambda: (step(), remote.placement.version)[1] == control.plane.board.version, 15, "the replica adopts it")
            wait(lambda: len(control.plane.registry.live_attention()) == 1, 10, "the replica registers again")

            # failover as before: a server goes away (its heartbeats and its port with it)
            async def gone(server):
                server._beats.cancel()
                await server.mesh.stop(0)

            loop.run(gone(experts[1]), 30)
            started = time.monotonic()
            step()
            print(f"\nfailover after the restart: the step took {time.monotonic() - started:.2f}s")
            assert remote.placement.servers() == (ids[0],)
            assert control.plane.registry.experts[ids[1]].info.state == "dead"
            loop.run(follower.close(), 20)
            remote.close()
    finally:
        loop.run(control.shutdown(0.1), 30)
