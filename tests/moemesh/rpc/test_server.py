import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from moemesh.rpc.config import RpcConfig
from moemesh.rpc.protos import load
from moemesh.rpc.server import Service, build_server, make_channel
from tests.fixtures.auth import TEST_SECURITY

expert_pb2, expert_grpc = load("expert")


class EchoExperts(expert_grpc.ExpertServiceServicer):
    async def GetStats(self, request, context):
        return expert_pb2.ExpertStats(requests=7)

    async def ForwardStream(self, request_iterator, context):
        async for request in request_iterator:
            yield expert_pb2.ForwardResponse(call_id=request.call_id, y=request.x)


async def check(stub, name):
    return (await stub.Check(health_pb2.HealthCheckRequest(service=name))).status


def test_health_reflection_limits_and_shutdown():
    async def main():
        cfg = RpcConfig(max_message_mb=1, shutdown_grace_s=0.5, security=TEST_SECURITY)
        server = build_server(cfg, Service(expert_grpc.add_ExpertServiceServicer_to_server, EchoExperts(), "moemesh.v1.ExpertService"))
        port = server.bind("127.0.0.1:0")
        await server.start()
        async with make_channel(f"127.0.0.1:{port}", cfg) as ch:
            h = health_pb2_grpc.HealthStub(ch)
            assert await check(h, "") == health_pb2.HealthCheckResponse.SERVING
            assert await check(h, "moemesh.v1.ExpertService") == health_pb2.HealthCheckResponse.SERVING
            stub = expert_grpc.ExpertServiceStub(ch)
            assert (await stub.GetStats(expert_pb2.GetStatsRequest())).requests == 7
            # reflection lists our service
            r = reflection_pb2_grpc.ServerReflectionStub(ch)
            names = []
            async for resp in r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])):
                names += [s.name for s in resp.list_services_response.service]
            assert "moemesh.v1.ExpertService" in names and "grpc.health.v1.Health" in names
            # a message over the configured limit is refused, not crashed on
            small = expert_pb2.ForwardRequest(call_id=1, x={"dtype": "uint8", "shape": [4], "data": b"\0" * 4})
            assert [r.call_id async for r in stub.ForwardStream(iter([small]))] == [1]
            big = expert_pb2.ForwardRequest(x={"dtype": "uint8", "shape": [2 << 20], "data": b"\0" * (2 << 20)})
            with pytest.raises(grpc.aio.AioRpcError) as e:
                [r async for r in stub.ForwardStream(iter([big]))]
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            await server.set_serving(False)
            assert await check(h, "") == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await check(h, "moemesh.v1.ExpertService") == health_pb2.HealthCheckResponse.NOT_SERVING
        await server.shutdown()
        async with make_channel(f"127.0.0.1:{port}", cfg) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await expert_grpc.ExpertServiceStub(ch).GetStats(expert_pb2.GetStatsRequest(), timeout=2)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(asyncio.wait_for(main(), 30))


def test_make_channel_rejects_bad_address():
    with pytest.raises(ValueError, match="host:port"):
        make_channel("nowhere", RpcConfig())
