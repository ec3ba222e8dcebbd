import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kernels import grouped_expert_mlp
from moemesh.rpc.protos import load
from moemesh.rpc.server import make_channel
from moemesh.transport.codec import decode, encode
from tests.expert_svc.fixtures import all_weights, routed_rows, running_expert_servers
from tests.fixtures.auth import TEST_RPC

expert_pb2, expert_grpc = load("expert")


def call(loop, port, method, request, **kw):
    async def go():
        async with make_channel(f"127.0.0.1:{port}", TEST_RPC) as ch:
            return await getattr(expert_grpc.ExpertServiceStub(ch), method)(request, timeout=20, **kw)

    return loop.run(go(), 30)


def forward_request(layer, x, ids, counts):
    req = expert_pb2.ForwardRequest(layer=layer, placement_version=1, expert_ids=ids.tolist(), counts=counts.tolist())
    encode(x, out=req.x)
    return req


def test_forward_over_grpc_equals_grouped_gemm(moe_dir, loop):
    # the server holds float32 experts [in, out] (matmul_layout), which the compiled CPU kernels do not
    # read: it runs the torch path, which the expected values use, bit for bit
    cfg, weights = all_weights(moe_dir)
    with running_expert_servers(moe_dir, 1, loop, preload="all", transport="grpc") as (srv,):
        for layer in cfg.moe_layers:
            x, ids, counts = routed_rows(17, [7, 0, 3], seed=layer)
            y = decode(call(loop, srv.port, "Forward", forward_request(layer, x, ids, counts)).y)
            torch.testing.assert_close(y, grouped_expert_mlp(x, ids, counts, weights[layer], backend="torch"), rtol=0, atol=0)
        bf = torch.randn(5, 64).to(torch.bfloat16)
        ids, counts = torch.tensor([2]), torch.tensor([5])
        y = decode(call(loop, srv.port, "Forward", forward_request(0, bf, ids, counts)).y)
        assert y.dtype == torch.bfloat16
        want = grouped_expert_mlp(bf.float(), ids, counts, weights[0], backend="torch").to(torch.bfloat16)
        torch.testing.assert_close(y, want, rtol=0, atol=0)
        stats = call(loop, srv.port, "GetStats", expert_pb2.GetStatsRequest())
        assert stats.requests == len(cfg.moe_layers) + 1
        assert sum(l.tokens for l in stats.loads) == 17 * len(cfg.moe_layers) + 5


def test_unknown_expert_is_failed_precondition_and_live_load_drop(moe_dir, loop):
    cfg, weights = all_weights(moe_dir)
    with running_expert_servers(moe_dir, 1, loop, transport="grpc") as (srv,):
        x, ids, counts = routed_rows(6, [4, 5])
        with pytest.raises(grpc.aio.AioRpcError) as e:
            call(loop, srv.port, "Forward", forward_request(1, x, ids, counts))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "layer 1" in e.value.details()
        held = call(loop, srv.port, "LoadExperts", expert_pb2.LoadExpertsRequest(experts=[expert_pb2.LayerExperts(layer=1, expert_ids=[4, 5, 6])]))
        assert [(le.layer, list(le.expert_ids)) for le in held.experts] == [(1, [4, 5, 6])]
        y = decode(call(loop, srv.port, "Forward", forward_request(1, x, ids, counts)).y)
        torch.testing.assert_close(y, grouped_expert_mlp(x, ids, counts, weights[1]))  # float32 rounding: held [in, out]
        held = call(loop, srv.port, "DropExperts", expert_pb2.DropExpertsRequest(experts=[expert_pb2.LayerExperts(layer=1, expert_ids=[5])]))
        assert [(le.layer, list(le.expert_ids)) for le in held.experts] == [(1, [4, 6])]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            call(loop, srv.port, "Forward", forward_request(1, x, ids, counts))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "experts [5]" in e.value.details()


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda r: r.x.__setattr__("dtype", "pickle"), "x.dtype"),
        (lambda r: r.x.__setattr__("data", r.x.data[:-4]), "x.data"),
        (lambda r: r.ClearField("x"), "x is missing"),
        (lambda r: r.counts.append(1), "counts has"),
        (lambda r: r.__setattr__("layer", 9), "layer 9"),
        (lambda r: r.weights.CopyFrom(encode(torch.rand(4, 1))), "counts must be empty when weights is set"),
        (lambda r: (r.ClearField("counts"), r.weights.CopyFrom(encode(torch.rand(4, 2)))), "weights must be [T, G] = [4, 1]"),
        (lambda r: (r.ClearField("counts"), r.weights.CopyFrom(encode(torch.rand(4, 1).double()))), "weights.dtype must be float32"),
        (lambda r: (r.ClearField("counts"), r.weights.__setattr__("dtype", "pickle")), "weights.dtype"),
    ],
)
def test_garbage_requests_are_invalid_argument(moe_dir, loop, mutate, match):
    with running_expert_servers(moe_dir, 1, loop, transport="grpc", preload="all") as (srv,):
        x, ids, counts = routed_rows(4, [1])
        req = forward_request(0, x, ids, counts)
        mutate(req)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            call(loop, srv.port, "Forward", req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in e.value.details()


def test_health_and_reflection(moe_dir, loop):
    with running_expert_servers(moe_dir, 1, loop, transport="grpc") as (srv,):
        async def go():
            async with make_channel(f"127.0.0.1:{srv.port}", TEST_RPC) as ch:
                h = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="moemesh.v1.ExpertService"))
                names = []
                async for resp in reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                ):
                    names += [s.name for s in resp.list_services_response.service]
                return h.status, names

        status, names = loop.run(go(), 30)
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert "moemesh.v1.ExpertService" in names and "grpc.reflection.v1alpha.ServerReflection" in names


def test_unexpected_failure_is_internal_and_the_server_keeps_serving(moe_dir, loop):
    with running_expert_servers(moe_dir, 1, loop, transport="grpc") as (srv,):
        def broken_load(layer, experts):
            raise OSError("checkpoint shard vanished")

        real_load = srv.shard.load
        srv.shard.load = broken_load
        req = expert_pb2.LoadExpertsRequest(experts=[expert_pb2.LayerExperts(layer=0, expert_ids=[1])])
        with pytest.raises(grpc.aio.AioRpcError) as e:
            call(loop, srv.port, "LoadExperts", req)
        assert e.value.code() == grpc.StatusCode.INTERNAL and "checkpoint shard vanished" in e.value.details()
        srv.shard.load = real_load
        assert call(loop, srv.port, "LoadExperts", req).experts[0].expert_ids == [1]
        bad = expert_pb2.LoadExpertsRequest(experts=[expert_pb2.LayerExperts(layer=0, expert_ids=[8])])
        with pytest.raises(grpc.aio.AioRpcError) as e:
            call(loop, srv.port, "LoadExperts", bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "expert_ids [8]" in e.value.details()
