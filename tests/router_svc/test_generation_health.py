"""The router process over real gRPC: the Generation service's health follows whether an attention
replica can serve (the process's own "" status does not), and CountTokens answers."""
import asyncio

from grpc_health.v1 import health_pb2

from moemesh.rpc.generation import SERVICE_NAME, GenerationClient, build_request
from moemesh.rpc.server import Service, build_server
from router_svc.attention_client import pb, pb_grpc
from router_svc.config import RouterConfig
from router_svc.server import create_server
from tests.fixtures.auth import TEST_RPC
from tests.router_svc.test_discovery_server import ScriptedAttention


class SwitchableAttention(ScriptedAttention):
    serving = True

    async def GetLoad(self, request, context):
        return pb.LoadReport(serving=self.serving, total_blocks=8, free_blocks=8)


async def status(client: GenerationClient, service: str) -> int:
    return (await client.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status


async def wait_for(predicate, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if await predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_generation_health_follows_the_replicas_and_tokens_are_counted():
    async def main():
        attention = SwitchableAttention()
        switchable = build_server(TEST_RPC, Service(pb_grpc.add_AttentionServicer_to_server, attention, "moemesh.v1.Attention"))
        sport = switchable.bind("127.0.0.1:0")
        await switchable.start()
        router_server, rport = await create_server(RouterConfig(attention=f"127.0.0.1:{sport}", load_poll_s=0.05, connect_timeout_s=10, rpc=TEST_RPC))
        await router_server.start()
        client = GenerationClient(f"127.0.0.1:{rport}")
        try:
            assert await client.serving()
            attention.serving = False
            await wait_for(lambda: _not(client.serving()))
            assert await status(client, "") == health_pb2.HealthCheckResponse.SERVING
            assert await status(client, SERVICE_NAME) == health_pb2.HealthCheckResponse.NOT_SERVING
            attention.serving = True
            await wait_for(client.serving)
            assert await client.count_tokens(build_request(prompt_token_ids=[5, 6, 7]), timeout=5) == 3
        finally:
            await client.close()
            await router_server.shutdown(0)
            await switchable.shutdown(0)

    asyncio.run(main())


async def _not(awaitable) -> bool:
    return not await awaitable
