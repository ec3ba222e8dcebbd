"""What a caller with the mesh token may still not do: unusable knobs, absurd heartbeats, drops of
experts still placed; and what an operator can undo (undrain)."""
from __future__ import annotations

import asyncio
import math

import grpc
import pytest

from control_svc.config import ControlConfig
from control_svc.load import bounded_stats, window_load
from control_svc.server import create_server
from moemesh.contracts.info import ServerInfo
from moemesh.contracts.knobs import MoeKnobs, check_change
from moemesh.contracts.wire import control_grpc, control_pb2, placement_from_proto
from moemesh.errors import MeshError
from moemesh.rpc.protos import load as load_protos
from moemesh.rpc.server import make_channel
from tests.control_svc.test_plane import LAYERS, make_plane, settle, stats, two_servers
from tests.fixtures.expert_servers import running_expert_servers
from tests.fixtures.auth import TEST_RPC

expert_pb2, expert_grpc = load_protos("expert")


@pytest.mark.parametrize("cf", [math.inf, -math.inf, math.nan])
def test_non_finite_capacity_factors_are_refused_naming_the_field(cf):
    plane, *_ = make_plane()
    with pytest.raises(MeshError) as e:
        plane.check_knobs(None, cf, None)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.message.startswith("capacity_factor")
    with pytest.raises(ValueError, match="^capacity_factor for layer 1"):
        MoeKnobs().updated(capacity_factor=cf, layer=1)


@pytest.mark.parametrize("top_k", [0, 9])
def test_top_k_outside_1_to_E_is_refused(top_k):
    with pytest.raises(ValueError, match=r"^top_k must be in \[1, 8\]"):
        check_change(LAYERS, 8, top_k=top_k)


def test_negative_finite_capacity_factors_keep_their_meaning():
    check_change(LAYERS, 8, capacity_factor=-2.0)  # dropless up to |cf|
    assert MoeKnobs().updated(capacity_factor=-2.0).for_layer(0).capacity_factor == -2.0


def test_absurd_heartbeat_loads_are_clamped_and_unknown_experts_refused():
    huge = stats({(0, 1): 10**12, (1, 2): 2**64 - 1, (0, 3): 50})
    huge.window_seconds = math.inf
    huge.busy_seconds = math.nan
    huge.window_work.seconds = 10.0
    huge.window_work.compute_cpu_seconds, huge.window_work.call_cpu_seconds = math.inf, 1e12
    huge.window_work.change_cpu_seconds = -1.0
    b = bounded_stats(huge, LAYERS, 8, max_tokens_per_s=1000.0)
    assert b.window_seconds == 1.0 and b.busy_seconds == 0.0
    assert b.window_work.compute_cpu_seconds == 0.0 and b.window_work.call_cpu_seconds <= 10.0 * 4096
    assert b.window_work.change_cpu_seconds == 0.0
    load = window_load([b], LAYERS, 8)  # no overflow into int64
    assert load[0, 1] == 1000 and load[1, 2] == 1000 and load[0, 3] == 50
    long_window = stats({(0, 1): 10**12})
    long_window.window_seconds = 1e9
    assert bounded_stats(long_window, LAYERS, 8, 1000.0).loads[0].tokens == 3600 * 1000
    for bad, field in ((stats({(5, 0): 1}), "stats.loads[0].layer"), (stats({(0, 8): 1}), "stats.loads[0].expert_id")):
        with pytest.raises(MeshError) as e:
            bounded_stats(bad, LAYERS, 8, 1000.0)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.message.startswith(field)


def test_a_forged_heartbeat_cannot_swamp_the_load():
    async def main():
        plane, *_ = make_plane()
        await two_servers(plane)
        plane.heartbeat("expert-0", None, stats({(0, 0): 10**12}))
        assert plane.load()[0, 0] <= plane.cfg.max_expert_tokens_per_s * 1
        with pytest.raises(MeshError):
            plane.heartbeat("expert-1", None, stats({(7, 0): 1}))

    asyncio.run(main())


def test_undrain_serves_again_and_gets_experts_back():
    async def main():
        plane, ops, *_ = make_plane()
        await two_servers(plane)
        state, moving = plane.drain("expert-1")
        assert (state, moving) == ("draining", True)
        await settle(plane)
        assert "expert-1" not in plane.board.current.placement.servers()
        state, placing = plane.undrain("expert-1")
        assert (state, placing) == ("serving", True) and "expert-1" not in plane.moving
        await settle(plane)
        assert "expert-1" in plane.board.current.placement.servers() and ops.held["expert-1"]
        with pytest.raises(MeshError) as e:
            plane.undrain("expert-9")
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        plane.declare_dead("expert-0", "test")
        with pytest.raises(MeshError) as e:
            plane.undrain("expert-0")
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION

    asyncio.run(main())


def test_a_restarted_server_replaces_its_live_record_at_once():
    async def main():
        plane, *_ = make_plane()
        await two_servers(plane)
        new = plane.register_expert(ServerInfo("", "127.0.0.1:2"))  # expert-1's address: its restart
        assert "expert-1" not in plane.registry.experts and new.server_id == "expert-2"
        await settle(plane)
        assert "expert-1" not in plane.board.current.placement.servers()

    asyncio.run(main())


def test_drop_experts_is_refused_for_experts_the_placement_still_places(tiny_model_dir, loop):
    """DropExperts by anyone but the control plane's release: refused while the committed placement
    still gives the server those experts, so requests never lose them (the control plane's own
    release drops only copies its placement no longer names: tests/live/test_switching)."""
    control = loop.run(create_server(ControlConfig(model_dir=str(tiny_model_dir), expected_expert_servers=1, release_timeout_s=1.0,
                                                   rpc=TEST_RPC)), 30)[0]
    loop.run(control.start(), 30)

    async def scenario(server):
        await control.plane.wait_placed(30)
        async with make_channel(server.address, TEST_RPC) as ch:
            stub = expert_grpc.ExpertServiceStub(ch)
            req = expert_pb2.DropExpertsRequest(placement_version=99, experts=[expert_pb2.LayerExperts(layer=0, expert_ids=[0, 1])])
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.DropExperts(req, timeout=10)
            return e.value, server.shard.held()

    try:
        with running_expert_servers(tiny_model_dir, 1, loop, transport="grpc", control_addr=control.address) as (server,):
            err, held = loop.run(scenario(server), 60)
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "layer 0 expert 0" in err.details() and "only the control plane drops experts" in err.details()
            assert {0, 1} <= set(held[0])
            placement = control.plane.board.current.placement
            assert set(placement.experts_on(server.agent.server_id)[0]) == set(held[0])
    finally:
        loop.run(control.shutdown(0.2), 30)


def test_undrain_and_bad_knobs_over_grpc(tiny_model_dir, loop):
    control = loop.run(create_server(ControlConfig(model_dir=str(tiny_model_dir), expected_expert_servers=1, release_timeout_s=1.0,
                                                   rpc=TEST_RPC)), 30)[0]
    loop.run(control.start(), 30)

    async def scenario():
        async with make_channel(control.address, TEST_RPC) as ch:
            stub = control_grpc.ControlServiceStub(ch)
            codes = {}
            for name, req in (("inf", control_pb2.SetKnobsRequest(capacity_factor=math.inf)),
                              ("top_k", control_pb2.SetKnobsRequest(top_k=99))):
                try:
                    await stub.SetKnobs(req, timeout=10)
                except grpc.aio.AioRpcError as e:
                    codes[name] = (e.code(), e.details())
            try:
                await stub.Undrain(control_pb2.UndrainRequest(id="expert-7"), timeout=10)
            except grpc.aio.AioRpcError as e:
                codes["undrain"] = (e.code(), e.details())
            return codes

    try:
        with running_expert_servers(tiny_model_dir, 1, loop, transport="grpc", control_addr=control.address):
            codes = loop.run(scenario(), 60)
    finally:
        loop.run(control.shutdown(0.2), 30)
    assert codes["inf"][0] == grpc.StatusCode.INVALID_ARGUMENT and codes["inf"][1].startswith("capacity_factor")
    assert codes["top_k"][0] == grpc.StatusCode.INVALID_ARGUMENT and codes["top_k"][1].startswith("top_k")
    assert codes["undrain"][0] == grpc.StatusCode.NOT_FOUND
