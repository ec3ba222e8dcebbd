"""Authentication of every server built by `moemesh.rpc.server`: the mesh token, mTLS, the API key."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from moemesh.rpc.config import RpcConfig
from moemesh.rpc.protos import load
from moemesh.rpc.security import SecurityConfig, api_key_credential, peer_host
from moemesh.rpc.server import Service, build_server, make_channel, make_sync_channel
from tests.fixtures.auth import TEST_RPC, TEST_SECURITY, TEST_TOKEN, make_pki

expert_pb2, expert_grpc = load("expert")
UNAUTH = grpc.StatusCode.UNAUTHENTICATED


class Experts(expert_grpc.ExpertServiceServicer):
    async def GetStats(self, request, context):
        return expert_pb2.ExpertStats(requests=7)

    async def ForwardStream(self, request_iterator, context):
        async for req in request_iterator:
            yield expert_pb2.ForwardResponse(call_id=req.call_id)


def serve(rpc: RpcConfig, credential=None):
    """A started server of `Experts` on a free loopback port (inside the running loop): (server, address)."""
    async def start():
        server = build_server(rpc, Service(expert_grpc.add_ExpertServiceServicer_to_server, Experts(), "moemesh.v1.ExpertService"),
                              credential=credential)
        port = server.bind("127.0.0.1:0")
        await server.start()
        return server, f"127.0.0.1:{port}"
    return start()


async def calls(address: str, rpc: RpcConfig, api_key: str = "") -> dict[str, grpc.StatusCode]:
    """The status of a unary call, a bidirectional stream, reflection and a health check. The two
    client-streaming calls go through the synchronous client, in a thread: when a server ends such a
    call before the client half-closes (as a refusal does, reading nothing), grpcio's asyncio client
    sometimes reports INTERNAL "Internal error from Core" in place of the status the server sent
    (grpc/grpc#36066), which the synchronous client reports as sent."""
    out = {}
    async with make_channel(address, rpc, api_key=api_key) as ch:
        stub = expert_grpc.ExpertServiceStub(ch)
        try:
            await stub.GetStats(expert_pb2.GetStatsRequest(), timeout=10)
            out["unary"] = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            out["unary"] = e.code()
        out.update(await asyncio.to_thread(streaming_calls, address, rpc, api_key))
        try:
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            out["health"] = grpc.StatusCode.OK if resp.status == health_pb2.HealthCheckResponse.SERVING else grpc.StatusCode.UNKNOWN
        except grpc.aio.AioRpcError as e:
            out["health"] = e.code()
    return out


def streaming_calls(address: str, rpc: RpcConfig, api_key: str) -> dict[str, grpc.StatusCode]:
    """The status of a bidirectional stream and of reflection, on the synchronous client."""
    out = {}
    with make_sync_channel(address, rpc, api_key=api_key) as ch:
        try:
            got = [r.call_id for r in expert_grpc.ExpertServiceStub(ch).ForwardStream(iter([expert_pb2.ForwardRequest(call_id=3)]), timeout=10)]
            assert got == [3]
            out["stream"] = grpc.StatusCode.OK
        except grpc.RpcError as e:
            out["stream"] = e.code()
        try:
            r = reflection_pb2_grpc.ServerReflectionStub(ch)
            for _ in r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10):
                pass
            out["reflection"] = grpc.StatusCode.OK
        except grpc.RpcError as e:
            out["reflection"] = e.code()
    return out


ALL_OK = {"unary": grpc.StatusCode.OK, "stream": grpc.StatusCode.OK, "reflection": grpc.StatusCode.OK, "health": grpc.StatusCode.OK}
REFUSED = {"unary": UNAUTH, "stream": UNAUTH, "reflection": UNAUTH, "health": grpc.StatusCode.OK}


def test_every_call_but_health_needs_the_mesh_token():
    async def main():
        server, address = await serve(TEST_RPC)
        try:
            assert await calls(address, TEST_RPC) == ALL_OK
            assert await calls(address, RpcConfig()) == REFUSED  # no token: only the health check answers
            wrong = RpcConfig(security=SecurityConfig(mesh_token="x" + TEST_TOKEN[1:]))
            assert await calls(address, wrong) == REFUSED
        finally:
            await server.shutdown(0)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_sync_channel_carries_the_token_too():
    async def main():
        server, address = await serve(TEST_RPC)
        try:
            def sync_call(rpc):
                with make_sync_channel(address, rpc) as ch:
                    return expert_grpc.ExpertServiceStub(ch).GetStats(expert_pb2.GetStatsRequest(), timeout=10).requests
            assert await asyncio.to_thread(sync_call, TEST_RPC) == 7
            with pytest.raises(grpc.RpcError) as e:
                await asyncio.to_thread(sync_call, RpcConfig())
            assert e.value.code() == UNAUTH
        finally:
            await server.shutdown(0)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_no_token_refuses_to_serve_unless_told_insecure():
    async def main():
        with pytest.raises(ValueError, match="mesh_token_file: no mesh token.*--insecure-no-auth"):
            build_server(RpcConfig(), Service(expert_grpc.add_ExpertServiceServicer_to_server, Experts(), "x"))
        server, address = await serve(RpcConfig(security=SecurityConfig(insecure_no_auth=True)))
        try:
            assert await calls(address, RpcConfig()) == ALL_OK
        finally:
            await server.shutdown(0)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_api_key_credential_for_the_public_api():
    async def main():
        server, address = await serve(RpcConfig(), credential=api_key_credential("k" * 24))
        try:
            assert await calls(address, RpcConfig(), api_key="k" * 24) == ALL_OK
            assert await calls(address, RpcConfig()) == REFUSED
            assert await calls(address, RpcConfig(), api_key="k" * 23 + "j") == REFUSED
            assert await calls(address, TEST_RPC) == REFUSED  # the mesh token is not the API key
        finally:
            await server.shutdown(0)
        open_server, address = await serve(RpcConfig(), credential=api_key_credential(""))  # no key configured: open
        try:
            assert await calls(address, RpcConfig()) == ALL_OK
        finally:
            await open_server.shutdown(0)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_mutual_tls(tmp_path):
    pki = make_pki(tmp_path)

    async def main():
        server_rpc = RpcConfig(security=pki.security("server", mesh_token=TEST_TOKEN))
        server, address = await serve(server_rpc)
        try:
            client = RpcConfig(security=pki.security("client", mesh_token=TEST_TOKEN))
            assert await calls(address, client) == ALL_OK
            # dialed by another name than the certificate's (one certificate for the whole mesh)
            by_name = RpcConfig(security=pki.security("client", mesh_token=TEST_TOKEN, tls_server_name="moemesh.internal"))
            assert await calls(address, by_name) == ALL_OK
            wrong_name = RpcConfig(security=pki.security("client", mesh_token=TEST_TOKEN, tls_server_name="elsewhere.example"))
            assert set((await calls(address, wrong_name)).values()) == {grpc.StatusCode.UNAVAILABLE}
            # plaintext, or a certificate from another CA: no connection at all (health included)
            assert set((await calls(address, TEST_RPC)).values()) == {grpc.StatusCode.UNAVAILABLE}
            outsider = RpcConfig(security=SecurityConfig(tls_cert=str(pki.other_cert), tls_key=str(pki.other_key), tls_ca=str(pki.ca),
                                                         mesh_token=TEST_TOKEN))
            assert set((await calls(address, outsider)).values()) == {grpc.StatusCode.UNAVAILABLE}
            # TLS does not replace the token
            no_token = RpcConfig(security=pki.security("client"))
            assert await calls(address, no_token) == REFUSED
        finally:
            await server.shutdown(0)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_plaintext_health_port_for_probes(tmp_path):
    """With TLS the kubelet's gRPC probe cannot connect; `health_port` serves the health service alone in plaintext."""
    pki = make_pki(tmp_path)

    async def main():
        rpc = RpcConfig(health_port=0, security=pki.security("server", mesh_token=TEST_TOKEN))
        server = build_server(rpc, Service(expert_grpc.add_ExpertServiceServicer_to_server, Experts(), "moemesh.v1.ExpertService"))
        server.bind("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.health_port}") as ch:
                resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="moemesh.v1.ExpertService"), timeout=10)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
                with pytest.raises(grpc.aio.AioRpcError) as e:  # nothing else is served there
                    await expert_grpc.ExpertServiceStub(ch).GetStats(expert_pb2.GetStatsRequest(), timeout=10)
                assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
                await server.set_serving(False)
                resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
                assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
        finally:
            await server.shutdown(0)

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize("kw, field", [
    ({"mesh_token": "short"}, "mesh_token"),
    ({"mesh_token": TEST_TOKEN, "insecure_no_auth": True}, "insecure_no_auth"),
    ({"tls_cert": "/etc/hostname"}, "tls_ca"),
    ({"mesh_token_file": "/nonexistent/token"}, "mesh_token_file"),
])
def test_security_config_names_the_bad_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SecurityConfig(**kw)


def test_token_file(tmp_path):
    f = tmp_path / "token"
    f.write_text(TEST_TOKEN + "\n")
    sec = SecurityConfig(mesh_token_file=str(f))
    assert sec.token() == TEST_TOKEN
    with pytest.raises(ValueError, match="mesh_token_file: give the mesh token once"):
        SecurityConfig(mesh_token_file=str(f), mesh_token=TEST_TOKEN)


def test_peer_host():
    assert peer_host("ipv4:10.0.0.7:51234") == "ipv4:10.0.0.7"
    assert peer_host("ipv6:[::1]:5") == "ipv6:[::1]"
    assert peer_host("unix:/tmp/s") == "unix:/tmp/s"


def test_the_token_is_never_a_flag_and_comes_from_the_environment():
    from control_svc.config import ControlConfig
    from moemesh.svc_config import field_specs, from_sources, parse_config

    spec = next(s for s in field_specs(ControlConfig) if s.name == "mesh_token")
    assert spec.flag == "" and spec.global_env == "MOEMESH_MESH_TOKEN"
    cfg = from_sources(ControlConfig, "control", None, {"MOEMESH_CONTROL_MODEL_DIR": "/m", "MOEMESH_MESH_TOKEN": TEST_TOKEN})
    assert cfg.rpc.security.token() == TEST_TOKEN
    with pytest.raises(SystemExit):
        parse_config(ControlConfig, "control", ["--model-dir", "/m", "--mesh-token", TEST_TOKEN], env={})
    with pytest.raises(ValueError, match="mesh_token_file: no mesh token"):
        ControlConfig(model_dir="/m")
    assert ControlConfig(model_dir="/m", rpc=RpcConfig(security=SecurityConfig(insecure_no_auth=True))).rpc.security.insecure_no_auth


def test_moemesh_serve_without_a_token_is_a_one_line_error(capsys, monkeypatch):
    from moemesh.cli.main import main

    monkeypatch.delenv("MOEMESH_MESH_TOKEN", raising=False)
    assert main(["serve", "control", "--model-dir", "/m"]) == 2
    err = capsys.readouterr().err
    assert "no mesh token" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_repr_hides_secrets():
    assert TEST_TOKEN not in repr(TEST_SECURITY) and TEST_TOKEN not in repr(TEST_RPC)
