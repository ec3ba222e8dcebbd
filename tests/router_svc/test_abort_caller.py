"""Abort is honoured only from the caller that started the request (API key, TLS client certificate,
peer host); to anyone else the request is as if it did not exist."""
from __future__ import annotations

import asyncio

from moemesh.rpc.config import RpcConfig
from moemesh.rpc.protos import load
from moemesh.rpc.security import SecurityConfig, api_key_credential
from moemesh.rpc.server import Service, build_server, make_channel
from moemesh.rpc.generation import build_request
from router_svc.servicer import SERVICE_NAME, GenerationServicer, add_to_server
from router_svc.types import GenerationInput
from tests.fixtures.auth import make_pki
from tests.router_svc.fakes import FakeAttention
from tests.router_svc.test_router import collect, make_router

pb, pb_grpc = load("generation")


def test_router_aborts_only_for_the_caller_that_started_the_request(info, tokenizer):
    fake = FakeAttention(range(10, 200), delay_s=0.002)
    router = make_router(info, tokenizer, fake)

    async def main():
        task = asyncio.create_task(
            collect_as(router, GenerationInput(request_id="r", prompt_token_ids=(5,)), "alice"))
        await asyncio.sleep(0.02)
        assert await router.abort("r", caller="mallory") is False
        assert await router.abort("r") is False
        assert await router.abort("r", caller="alice") is True
        return await task

    items = asyncio.run(main())
    assert items[-1].finish_reason == "abort" and fake.aborted == ["r"]


async def collect_as(router, req, caller):
    return [item async for item in router.generate(req, caller=caller)]


def test_abort_over_grpc_by_another_client_certificate_is_not_honoured(info, tokenizer, tmp_path):
    """Two clients of one mTLS router, told apart by their certificates: the second cannot abort the
    first one's stream by its id; the first can."""
    pki = make_pki(tmp_path)
    fake = FakeAttention(range(10, 60), delay_s=0.02)
    router = make_router(info, tokenizer, fake)
    alice = RpcConfig(security=SecurityConfig(tls_cert=str(pki.client_cert), tls_key=str(pki.client_key), tls_ca=str(pki.ca)))
    mallory = RpcConfig(security=SecurityConfig(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key), tls_ca=str(pki.ca)))

    async def main():
        rpc = RpcConfig(security=pki.security("server", insecure_no_auth=True))
        server = build_server(rpc, Service(add_to_server, GenerationServicer(router), SERVICE_NAME), credential=api_key_credential("k" * 20))
        address = f"127.0.0.1:{server.bind('127.0.0.1:0')}"
        await server.start()
        try:
            async with make_channel(address, alice, api_key="k" * 20) as a, make_channel(address, mallory, api_key="k" * 20) as m:
                stream = pb_grpc.GenerationStub(a).Generate(build_request(request_id="victim", prompt_token_ids=[5], max_new_tokens=30))
                first = await stream.read()
                assert first.token_ids
                assert (await pb_grpc.GenerationStub(m).Abort(pb.AbortRequest(request_id="victim"))).found is False
                assert (await pb_grpc.GenerationStub(a).Abort(pb.AbortRequest(request_id="victim"))).found is True
                rest = [r async for r in stream]
                return rest[-1].finish_reason
        finally:
            await server.shutdown(0)

    assert asyncio.run(asyncio.wait_for(main(), 60)) == "abort"
