"""Control plane + expert servers (registered through their ControlAgent) + an attention replica's
RemoteExperts following the placement through its ControlFollower: the initial placement and one
live switch, end to end."""
import asyncio
import functools

import torch

from attention_svc.control_follower import ControlFollower
from attention_svc.remote_experts import RemoteExperts
from control_svc.config import ControlConfig
from control_svc.placement.types import Placement
from control_svc.server import build_control_server
from expert_svc.control_agent import ControlAgent
from expert_svc.serve import server_info
from expert_svc.servicer import stats_message
from moemesh.rpc.config import RpcConfig
from moemesh.transport.dist_transport import open_transport
from tests.expert_svc.fixtures import all_weights, in_loop, plan_expected, routed_plan, running_expert_servers


def test_initial_placement_then_live_switch(moe_dir, loop):
    cfg, weights = all_weights(moe_dir)
    control = loop.run(in_loop(build_control_server, ControlConfig(model_dir=str(moe_dir), expected_expert_servers=2, heartbeat_interval_s=0.1, dead_after_s=5.0)), 30)
    loop.run(control.server.start(), 30)
    try:
        with running_expert_servers(moe_dir, 2, loop, transport="grpc") as experts:
            async def register_all():
                agents = [ControlAgent(control.address, RpcConfig(), server_info(p), lambda p=p: stats_message(p.shard)) for p in experts]
                for a in agents:
                    await a.register()
                follower = ControlFollower(control.address, RpcConfig())
                placement, servers = await follower.first_placement(20)
                return agents, follower, placement, servers

            agents, follower, placement, servers = loop.run(register_all(), 30)
            assert placement.version == 1 and set(servers) == {a.server_id for a in agents}
            remote = RemoteExperts(placement, servers, functools.partial(open_transport, mode="auto", rpc=RpcConfig()))
            loop.run(follower.start(remote, "127.0.0.1:9"), 30)
            x, plan = routed_plan(30, top_k=2)
            for layer in cfg.moe_layers:
                torch.testing.assert_close(remote.submit(layer, x, plan).result(20), plan_expected(x, plan, weights[layer]))

            # live switch: every expert of every layer moves to the first server
            first = agents[0].server_id
            v2 = Placement(2, {l: tuple((first,) for _ in range(8)) for l in cfg.moe_layers})
            switch = loop.submit(control.plane.switch.switch(v2))
            for _ in range(200):  # the next step adopts v2 once it is committed
                if remote.begin_step() == 2:
                    break
                loop.run(asyncio.sleep(0.02), 5)
            assert remote.placement.version == 2
            switch.result(20)  # release waited for our heartbeat with adopted_version 2
            assert experts[0].shard.held() == {l: tuple(range(8)) for l in cfg.moe_layers}
            assert experts[1].shard.held() == {}  # old copies dropped
            for layer in cfg.moe_layers:
                torch.testing.assert_close(remote.submit(layer, x, plan).result(20), plan_expected(x, plan, weights[layer]))
            remote.close()

            async def close_all():
                for a in agents:
                    await a.deregister()
                    await a.close()
                await follower.close()

            loop.run(close_all(), 20)
            assert control.plane.registry.experts == {}
    finally:
        loop.run(control.server.shutdown(0.2), 30)
        loop.run(control.ops.close(), 30)


def test_draining_a_server_under_load_fails_no_request(moe_dir, loop):
    """SIGTERM's drain path: the control plane moves the server's experts to the other one, the
    attention side adopts the new placement between steps, old copies are dropped, and the server
    leaves; requests keep succeeding throughout."""
    import threading
    import time

    from expert_svc.serve import drain

    cfg, weights = all_weights(moe_dir)
    control = loop.run(in_loop(build_control_server, ControlConfig(model_dir=str(moe_dir), expected_expert_servers=2, heartbeat_interval_s=0.1, dead_after_s=5.0)), 30)
    loop.run(control.server.start(), 30)
    try:
        with running_expert_servers(moe_dir, 2, loop, transport="grpc") as experts:
            async def setup():
                agents = [ControlAgent(control.address, RpcConfig(), server_info(p), lambda p=p: stats_message(p.shard)) for p in experts]
                for a in agents:
                    await a.register()
                follower = ControlFollower(control.address, RpcConfig())
                return agents, follower, *(await follower.first_placement(20))

            agents, follower, placement, servers = loop.run(setup(), 30)
            remote = RemoteExperts(placement, servers, functools.partial(open_transport, mode="grpc", rpc=RpcConfig()))
            loop.run(follower.start(remote, "127.0.0.1:9"), 30)
            stop, errors, steps = threading.Event(), [], [0]
            x, plan = routed_plan(24, top_k=2)

            def attention_steps():
                while not stop.is_set():
                    for layer in cfg.moe_layers:  # one step: every MoE layer in order
                        try:
                            y = remote.submit(layer, x, plan).result(20)
                            torch.testing.assert_close(y, plan_expected(x, plan, weights[layer]), rtol=1e-5, atol=1e-5)
                        except Exception as e:  # noqa: BLE001 - collected and asserted on below
                            errors.append(e)
                    steps[0] += 1

            worker = threading.Thread(target=attention_steps)
            worker.start()
            try:
                while steps[0] < 3:
                    time.sleep(0.01)
                started = time.monotonic()
                loop.run(drain(experts[1], agents[1], timeout_s=20), 30)
                took = time.monotonic() - started
                steps_at_drain = steps[0]
                while steps[0] < steps_at_drain + 3:  # keeps working on the remaining server
                    time.sleep(0.01)
            finally:
                stop.set()
                worker.join(30)
            assert errors == []
            assert took < 10
            assert remote.placement.version == 2 and remote.placement.servers() == (agents[0].server_id,)
            assert experts[1].shard.held() == {}
            assert experts[0].shard.held() == {l: tuple(range(8)) for l in cfg.moe_layers}
            assert agents[1].server_id not in control.plane.registry.experts
            remote.close()

            async def close_all():
                await agents[0].deregister()
                for a in agents:
                    await a.close()
                await follower.close()

            loop.run(close_all(), 20)
    finally:
        loop.run(control.server.shutdown(0.2), 30)
        loop.run(control.ops.close(), 30)


def test_drain_does_not_wait_for_a_move_that_failed(moe_dir, loop):
    import time

    from expert_svc.serve import drain

    control = loop.run(in_loop(build_control_server, ControlConfig(model_dir=str(moe_dir), expected_expert_servers=2, heartbeat_interval_s=0.1, dead_after_s=5.0)), 30)
    loop.run(control.server.start(), 30)
    try:
        with running_expert_servers(moe_dir, 2, loop, transport="grpc") as experts:
            async def setup():
                agents = [ControlAgent(control.address, RpcConfig(), server_info(p), lambda p=p: stats_message(p.shard)) for p in experts]
                for a in agents:
                    await a.register()
                await control.plane.wait_placed(20)
                return agents

            agents = loop.run(setup(), 30)

            def refuse(layer, experts_):
                raise OSError("disk gone")

            experts[0].shard.load = refuse  # the move's prepare fails on the only other server
            started = time.monotonic()
            loop.run(drain(experts[1], agents[1], timeout_s=20), 30)
            assert time.monotonic() - started < 5
            assert control.plane.board.version == 1 and not control.plane.moving
            assert experts[1].shard.held()  # nothing was released
            assert agents[1].server_id not in control.plane.registry.experts

            async def close_all():
                for a in agents:
                    await a.close()

            loop.run(close_all(), 20)
    finally:
        loop.run(control.server.shutdown(0.2), 30)
        loop.run(control.ops.close(), 30)
