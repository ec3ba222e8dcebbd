import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from moemesh.rpc.protos import load
from moemesh.rpc.server import make_channel
from moemesh.transport.codec import decode, encode
from moemesh.transport.grpc_transport import request_message
from tests.fixtures.auth import TEST_RPC
from tests.fixtures.expert_servers import all_weights, expected, routed_request, running_expert_servers

expert_pb2, expert_grpc = load("expert")


def call(loop, port, method, request, **kw):
    async def go():
        async with make_channel(f"127.0.0.1:{port}", TEST_RPC) as ch:
            return await getattr(expert_grpc.ExpertServiceStub(ch), method)(request, timeout=20, **kw)

    return loop.run(go(), 30)


def stream(loop, port, requests):
    """The responses to `requests` sent on one ForwardStream."""
    async def go():
        async with make_channel(f"127.0.0.1:{port}", TEST_RPC) as ch:
            for i, r in enumerate(requests):
                r.call_id = i + 1
            return [r async for r in expert_grpc.ExpertServiceStub(ch).ForwardStream(iter(requests), timeout=20)]

    return loop.run(go(), 30)


def test_forward_stream_answers_each_call_with_its_partial_sum(tiny_model_dir, loop):
    cfg, weights = all_weights(tiny_model_dir)
    with running_expert_servers(tiny_model_dir, 1, loop, preload="all", transport="grpc") as (srv,):
        reqs = [routed_request(17, [7, 0, 3], layer=layer, seed=layer) for layer in cfg.moe_layers]
        bf = routed_request(5, [2], dtype=torch.bfloat16)
        answers = stream(loop, srv.port, [request_message(r) for r in reqs + [bf]])
        assert [a.call_id for a in answers] == list(range(1, len(reqs) + 2))
        for req, a in zip(reqs, answers):
            torch.testing.assert_close(decode(a.y), expected(req, weights[req.layer]), rtol=0, atol=0)
        y = decode(answers[-1].y)
        assert y.dtype == torch.bfloat16  # computed in the server's float32, answered in x's dtype
        want = expected(routed_request(5, [2]), weights[0])
        torch.testing.assert_close(y, want.to(torch.bfloat16), rtol=1e-2, atol=1e-2)
        stats = call(loop, srv.port, "GetStats", expert_pb2.GetStatsRequest())
        assert stats.requests == len(reqs) + 1
        assert sum(l.tokens for l in stats.loads) == sum(r.token_idx.numel() for r in reqs + [bf])


def test_unknown_expert_is_failed_precondition_and_live_load_drop(tiny_model_dir, loop):
    cfg, weights = all_weights(tiny_model_dir)
    with running_expert_servers(tiny_model_dir, 1, loop, transport="grpc") as (srv,):
        req = routed_request(6, [4, 5], layer=1)
        (a,) = stream(loop, srv.port, [request_message(req)])
        assert a.error_code == grpc.StatusCode.FAILED_PRECONDITION.value[0] and "layer 1" in a.error
        held = call(loop, srv.port, "LoadExperts", expert_pb2.LoadExpertsRequest(experts=[expert_pb2.LayerExperts(layer=1, expert_ids=[4, 5, 6])]))
        assert [(le.layer, list(le.expert_ids)) for le in held.experts] == [(1, [4, 5, 6])]
        work = call(loop, srv.port, "GetStats", expert_pb2.GetStatsRequest()).window_work
        assert work.change_cpu_seconds > 0 and work.compute_cpu_seconds == 0  # the load's CPU, apart from the calls'
        (a,) = stream(loop, srv.port, [request_message(req)])
        torch.testing.assert_close(decode(a.y), expected(req, weights[1]))  # float32 rounding: a subset of the experts held
        held = call(loop, srv.port, "DropExperts", expert_pb2.DropExpertsRequest(experts=[expert_pb2.LayerExperts(layer=1, expert_ids=[5])]))
        assert [(le.layer, list(le.expert_ids)) for le in held.experts] == [(1, [4, 6])]
        (a,) = stream(loop, srv.port, [request_message(req)])
        assert a.error_code == grpc.StatusCode.FAILED_PRECONDITION.value[0] and "experts [5]" in a.error


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda r: r.x.__setattr__("dtype", "pickle"), "x.dtype"),
        (lambda r: r.x.__setattr__("data", r.x.data[:-4]), "x.data"),
        (lambda r: r.ClearField("x"), "x: missing"),
        (lambda r: r.ClearField("token_idx"), "token_idx: missing"),
        (lambda r: r.ClearField("weights"), "weights: missing"),
        (lambda r: r.counts.append(1), "counts: must be int64 [G] = [1]"),
        (lambda r: r.__setattr__("layer", 9), "layer: 9"),
        (lambda r: r.token_idx.CopyFrom(encode(torch.tensor([0, 1, 2, 9], dtype=torch.int32))), "token_idx: every value"),
        (lambda r: r.token_idx.CopyFrom(encode(torch.arange(4))), "token_idx: must be int32"),
        (lambda r: r.weights.CopyFrom(encode(torch.rand(4).double())), "weights: must be float32"),
        (lambda r: r.weights.__setattr__("dtype", "pickle"), "weights.dtype"),
    ],
)
def test_garbage_requests_are_invalid_argument_and_the_stream_goes_on(tiny_model_dir, loop, mutate, match):
    cfg, weights = all_weights(tiny_model_dir)
    with running_expert_servers(tiny_model_dir, 1, loop, transport="grpc", preload="all") as (srv,):
        good = routed_request(4, [1], top_k=1)
        bad = request_message(good)
        mutate(bad)
        a, b = stream(loop, srv.port, [bad, request_message(good)])
        assert a.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and match in a.error, a.error
        torch.testing.assert_close(decode(b.y), expected(good, weights[0]))


def test_health_and_reflection(tiny_model_dir, loop):
    with running_expert_servers(tiny_model_dir, 1, loop, transport="grpc") as (srv,):
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


def test_unexpected_failure_is_internal_and_the_server_keeps_serving(tiny_model_dir, loop):
    with running_expert_servers(tiny_model_dir, 1, loop, transport="grpc") as (srv,):
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
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "expert_ids: [8]" in e.value.details()
        srv.shard.forward = lambda req: (_ for _ in ()).throw(KeyError("bug"))
        (a,) = stream(loop, srv.port, [request_message(routed_request(3, [1]))])
        assert a.error_code == grpc.StatusCode.INTERNAL.value[0] and "KeyError" in a.error


def test_the_all_experts_path_follows_the_config(tiny_ckpt, tiny_model_dir, loop):
    every = tiny_ckpt("mixtral", num_experts_per_tok=4, num_local_experts=4)[0]  # top-k == E
    for model_dir, applies in ((every, True), (tiny_model_dir, False)):  # a sparse model: never held
        for flag in (True, False):
            with running_expert_servers(model_dir, 1, loop, preload="all", transport="grpc", all_experts_path=flag) as (srv,):
                assert srv.shard.all_experts_path is (flag and applies)
                assert all((srv.shard._layers[layer].concatenated is not None) is (flag and applies) for layer in srv.shard.held())
