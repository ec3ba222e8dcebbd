"""Control plane + expert servers (registered through their ControlAgent) + an attention replica's
RemoteExperts following the placement through its ControlFollower: the initial placement and one
live switch, end to end."""
import asyncio
import functools
from contextlib import contextmanager

import torch

from attention_svc.control_follower import ControlFollower
from attention_svc.remote_experts import RemoteExperts
from control_svc.config import ControlConfig
from control_svc.server import create_server
from moemesh.contracts.placement import Placement
from moemesh.transport.dist_transport import open_transport
from tests.fixtures.auth import TEST_RPC
from tests.fixtures.expert_servers import all_weights, plan_expected, routed_plan, running_expert_servers


@contextmanager
def running_control(tiny_model_dir, loop):
    """A started control plane expecting two expert servers (heartbeats every 0.1 s)."""
    cfg = ControlConfig(model_dir=str(tiny_model_dir), expected_expert_servers=2, heartbeat_interval_s=0.1, dead_after_s=5.0, rpc=TEST_RPC)
    control, _ = loop.run(create_server(cfg), 30)
    loop.run(control.start(), 30)
    try:
        yield control
    finally:
        loop.run(control.shutdown(0.2), 30)


def follow(loop, control_addr: str, transport: str) -> tuple[ControlFollower, RemoteExperts]:
    """An attention replica's expert side: the follower, and RemoteExperts on the first placement."""
    async def attention():
        follower = ControlFollower(control_addr, TEST_RPC)
        placement, servers = await follower.first_placement(20)
        remote = RemoteExperts(placement, servers, functools.partial(open_transport, mode=transport, rpc=TEST_RPC))
        await follower.start(remote, "127.0.0.1:9")
        return follower, remote

    return loop.run(attention(), 30)


def close(loop, follower: ControlFollower, remote: RemoteExperts) -> None:
    loop.run(follower.close(), 20)
    remote.close()


def test_initial_placement_then_live_switch(tiny_model_dir, loop):
    cfg, weights = all_weights(tiny_model_dir)
    with running_control(tiny_model_dir, loop) as control:
        with running_expert_servers(tiny_model_dir, 2, loop, transport="grpc", control_addr=control.address) as experts:
            agents = [p.agent for p in experts]

            follower, remote = follow(loop, control.address, "auto")
            assert remote.placement.version == 1 and set(remote.placement.servers()) == {a.server_id for a in agents}
            x, plan = routed_plan(30, top_k=2)
            for layer in cfg.moe_layers:
                torch.testing.assert_close(remote.submit(layer, x, plan).result(20), plan_expected(x, plan, weights[layer]))

            # live switch: every expert of every layer moves to the first server
            first = agents[0].server_id
            v2 = Placement(2, {l: tuple((first,) for _ in range(8)) for l in cfg.moe_layers})
            switch = loop.submit(control.plane.switch.switch(v2))
            for _ in range(200):  # the next step adopts v2 once it is committed
                follower.begin_step()
                if remote.placement.version == 2:
                    break
                loop.run(asyncio.sleep(0.02), 5)
            assert remote.placement.version == 2
            switch.result(20)  # release waited for our heartbeat with adopted_version 2
            assert experts[0].shard.held() == {l: tuple(range(8)) for l in cfg.moe_layers}
            assert experts[1].shard.held() == {}  # old copies dropped
            for layer in cfg.moe_layers:
                torch.testing.assert_close(remote.submit(layer, x, plan).result(20), plan_expected(x, plan, weights[layer]))
            close(loop, follower, remote)


def test_draining_a_server_under_load_fails_no_request(tiny_model_dir, loop):
    """SIGTERM's drain path: the control plane moves the server's experts to the other one, the
    attention side adopts the new placement between steps, old copies are dropped, and the server
    leaves; requests keep succeeding throughout."""
    import threading
    import time

    cfg, weights = all_weights(tiny_model_dir)
    with running_control(tiny_model_dir, loop) as control:
        with running_expert_servers(tiny_model_dir, 2, loop, transport="grpc", control_addr=control.address) as experts:
            agents = [p.agent for p in experts]

            follower, remote = follow(loop, control.address, "grpc")
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
                loop.run(experts[1].drain(20), 30)
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
            close(loop, follower, remote)


def test_drain_does_not_wait_for_a_move_that_failed(tiny_model_dir, loop):
    import time

    with running_control(tiny_model_dir, loop) as control:
        with running_expert_servers(tiny_model_dir, 2, loop, transport="grpc", control_addr=control.address) as experts:
            agents = [p.agent for p in experts]
            loop.run(control.plane.wait_placed(20), 30)

            def refuse(layer, experts_):
                raise OSError("disk gone")

            experts[0].shard.load = refuse  # the move's prepare fails on the only other server
            started = time.monotonic()
            loop.run(experts[1].drain(20), 30)
            assert time.monotonic() - started < 5
            assert control.plane.board.version == 1 and not control.plane.moving
            assert experts[1].shard.held()  # nothing was released
            assert agents[1].server_id not in control.plane.registry.experts
