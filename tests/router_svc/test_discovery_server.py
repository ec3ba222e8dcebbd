"""The router process with discovery, over real gRPC on loopback: one configured name expands to two
attention servers (127.0.0.1 and 127.0.0.2, same port), both get sequences, and when the name loses
one of them the router stops using it and closes its channel. The resolver is injected (no DNS)."""
import asyncio

from moemesh.rpc.server import Service, build_server
from router_svc.attention_client import pb, pb_grpc
from router_svc.config import RouterConfig
from router_svc.server import create_server
from router_svc.types import GenerationInput, SamplingSpec
from tests.fixtures.auth import TEST_RPC


class ScriptedAttention(pb_grpc.AttentionServicer):
    """Streams three tokens per sequence; records the request ids it got."""

    def __init__(self):
        self.request_ids = []

    async def Generate(self, request, context):
        self.request_ids.append(request.request_id)
        for i, t in enumerate((10, 11, 12)):
            await asyncio.sleep(0.002)
            yield pb.SequenceUpdate(token_ids=[t], finish_reason="length" if i == 2 else "")

    async def Abort(self, request, context):
        return pb.AbortSequenceResponse(found=False)

    async def GetLoad(self, request, context):
        return pb.LoadReport(serving=True, total_blocks=8, free_blocks=8)

    async def GetReplicaInfo(self, request, context):
        return pb.ReplicaInfo(architecture="MixtralForCausalLM", vocab_size=64, max_context=64, max_new_tokens_limit=16,
                              eos_token_ids=[2], num_experts=4, experts_per_token=2, num_layers=2, model_dir="/no-such-model")


async def start_pod(host, port):
    servicer = ScriptedAttention()
    server = build_server(TEST_RPC, Service(pb_grpc.add_AttentionServicer_to_server, servicer, "moemesh.v1.Attention"))
    bound = server.bind(f"{host}:{port}")
    await server.start()
    return server, servicer, bound


def test_a_name_becomes_one_replica_per_pod_and_follows_dns():
    async def main():
        first, a, port = await start_pod("127.0.0.1", 0)
        second, b, _ = await start_pod("127.0.0.2", port)  # all of 127.0.0.0/8 is loopback on Linux
        records = {"attention": ["127.0.0.1", "127.0.0.2"]}

        async def resolver(host, p):
            return records[host]

        cfg = RouterConfig(attention=f"attention:{port}", load_poll_s=0.05, discovery_interval_s=0.05, connect_timeout_s=10, rpc=TEST_RPC)
        router_server, _ = await create_server(cfg, resolver)
        await router_server.start()
        router = router_server.router
        try:
            assert [r.address for r in router.replicas.replicas] == [f"127.0.0.1:{port}", f"127.0.0.2:{port}"]
            spec = SamplingSpec(max_new_tokens=3)

            async def one(i):
                return [x async for x in router.generate(GenerationInput(request_id=f"r{i}", prompt_token_ids=(5,), sampling=spec))]

            results = await asyncio.gather(*(one(i) for i in range(6)))
            assert all(r[-1].finish_reason == "length" for r in results)
            assert len(a.request_ids) == 3 and len(b.request_ids) == 3

            records["attention"] = ["127.0.0.1"]
            for _ in range(100):
                if not router.replicas.retiring and len(router.replicas.replicas) == 1:
                    break
                await asyncio.sleep(0.02)
            assert [r.address for r in router.replicas.replicas] == [f"127.0.0.1:{port}"]
            await asyncio.gather(*(one(i) for i in range(6, 9)))
            assert len(a.request_ids) == 6 and len(b.request_ids) == 3
        finally:
            await router_server.shutdown(0)
            await first.shutdown(0)
            await second.shutdown(0)

    asyncio.run(main())
