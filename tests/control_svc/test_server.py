import asyncio

import grpc
import pytest

from control_svc.config import ControlConfig
from control_svc.server import create_server
from moemesh.contracts.info import ServerInfo
from moemesh.contracts.wire import control_grpc, control_pb2, placement_from_proto, server_from_proto, server_to_proto
from moemesh.models.registry import load_model_config
from moemesh.rpc.server import make_channel
from tests.fixtures.expert_servers import running_expert_servers
from tests.fixtures.auth import TEST_RPC


@pytest.fixture
def control(tiny_model_dir, loop):
    control_server = loop.run(create_server(ControlConfig(model_dir=str(tiny_model_dir), expected_expert_servers=2, release_timeout_s=1.0, rpc=TEST_RPC)), 30)[0]
    loop.run(control_server.start(), 30)
    yield control_server
    loop.run(control_server.shutdown(0.2), 30)


def test_initial_placement_loads_every_expert_onto_the_servers(tiny_model_dir, loop, control):
    async def scenario(experts):
        async with make_channel(control.address, TEST_RPC) as ch:
            stub = control_grpc.ControlServiceStub(ch)
            watch = stub.WatchPlacement(control_pb2.WatchPlacementRequest(replica_id="t", after_version=0))
            ids = []
            for p in experts:
                info = ServerInfo("", p.address, slot_budget=12, host_id="h", dist_addr="")
                resp = await stub.RegisterExpertServer(control_pb2.RegisterExpertServerRequest(server=server_to_proto(info)))
                ids.append(resp.server_id)
                assert resp.heartbeat_interval_s > 0
            first = await asyncio.wait_for(watch.read(), 10)
            watch.cancel()
            got = await stub.GetPlacement(control_pb2.GetPlacementRequest())
            hb = await stub.Heartbeat(control_pb2.HeartbeatRequest(id=ids[0]))
            return ids, first, got, hb

    with running_expert_servers(tiny_model_dir, 2, loop, transport="grpc") as experts:
        ids, first, got, hb = loop.run(scenario(experts), 30)
        placement = placement_from_proto(got.placement)
        assert placement.version == 1 and placement_from_proto(first.placement) == placement
        assert hb.known and hb.placement_version == 1
        assert sorted(server_from_proto(s).server_id for s in got.servers) == sorted(ids)
        assert placement.layers == (0, 1)
        for layer in placement.layers:
            assert len(placement.replicas[layer]) == 8
        for sid, srv in zip(ids, experts):
            want = placement.experts_on(sid)
            assert srv.shard.held() == want  # prepare loaded exactly what the placement assigns
            assert sum(len(v) for v in want.values()) == 8  # 16 pairs over 2 servers


def test_bad_calls_get_the_right_status(loop, control):
    async def scenario():
        async with make_channel(control.address, TEST_RPC) as ch:
            stub = control_grpc.ControlServiceStub(ch)
            codes = []
            for call in (
                stub.RegisterExpertServer(control_pb2.RegisterExpertServerRequest(server=control_pb2.ExpertServerInfo(address="x"))),
                stub.Drain(control_pb2.DrainRequest(id="expert-42")),
                stub.Deregister(control_pb2.DeregisterRequest(id="expert-42")),
                stub.Heartbeat(control_pb2.HeartbeatRequest()),
            ):
                try:
                    await call
                except grpc.aio.AioRpcError as e:
                    codes.append((e.code(), e.details()))
            unknown = await stub.Heartbeat(control_pb2.HeartbeatRequest(id="expert-42"))
            return codes, unknown

    codes, unknown = loop.run(scenario(), 30)
    assert codes[0][0] == grpc.StatusCode.INVALID_ARGUMENT and "server.address" in codes[0][1]
    assert codes[1][0] == grpc.StatusCode.NOT_FOUND and "expert-42" in codes[1][1]
    assert codes[2][0] == grpc.StatusCode.NOT_FOUND
    assert codes[3][0] == grpc.StatusCode.INVALID_ARGUMENT and "id" in codes[3][1]
    assert not unknown.known


def test_metrics_endpoint_and_status_rpc(tiny_model_dir, loop):
    import urllib.request

    control_server = loop.run(create_server(ControlConfig(model_dir=str(tiny_model_dir), metrics_port=0, rpc=TEST_RPC)), 30)[0]
    loop.run(control_server.start(), 30)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{control_server.metrics_server.port}/metrics", timeout=10).read().decode()
        assert 'moemesh_placement_balancedness{service="control"}' in body

        async def status():
            async with make_channel(control_server.address, TEST_RPC) as ch:
                stub = control_grpc.ControlServiceStub(ch)
                st = await stub.GetStatus(control_pb2.GetStatusRequest(), timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Rebalance(control_pb2.RebalanceRequest(), timeout=10)
                return st, e.value

        st, err = loop.run(status(), 30)
        assert st.placement_version == 0 and list(st.servers) == [] and st.balancedness == 1.0
        model = load_model_config(str(tiny_model_dir))
        assert sorted((el.layer, el.expert_id, el.tokens) for el in st.expert_loads) == [
            (layer, e, 0) for layer in model.moe_layers for e in range(model.num_experts)]  # the heat map, idle
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "no placement yet" in err.details()
    finally:
        loop.run(control_server.shutdown(0.2), 30)
