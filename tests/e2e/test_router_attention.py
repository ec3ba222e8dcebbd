"""Router + one attention replica (experts computed in the replica) as real processes on loopback:
results equal `moemesh run`, concurrency, bad input, admission, cancellation and deadlines."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from moemesh.launcher.child import stop_all
from moemesh.rpc.generation import build_request
from tests.fixtures.services import assert_same_generation, gen_grpc, gen_pb, generate_json, run_json, start_service, wait_idle


@pytest.fixture(scope="module")
def services(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    children = []
    try:
        att, att_addr = start_service("attention", logs, model_dir=tiny_model_dir, kv_cache_tokens=2048)
        children.append(att)
        router, router_addr = start_service("router", logs, attention=att_addr)
        children.append(router)
        tight, tight_addr = start_service("router", logs, name="tight-router", attention=att_addr,
                                          max_running=1, max_queued=0, max_message_mb=1)
        children.append(tight)
        yield {"attention": att_addr, "router": router_addr, "tight": tight_addr}
    finally:
        stop_all(children, 10)


@pytest.fixture(scope="module")
def stub(services):
    with grpc.insecure_channel(services["router"]) as ch:
        yield gen_grpc.GenerationStub(ch)


def collect(stub, timeout=60, **kw):
    return list(stub.Generate(build_request(**kw), timeout=timeout))


def test_model_info(stub, tiny_model_dir):
    info = stub.GetModelInfo(gen_pb.GetModelInfoRequest(), timeout=10)
    assert info.name == tiny_model_dir.name and info.vocab_size == 512 and info.max_context == 256
    assert info.has_chat_template and info.num_experts == 8 and info.experts_per_token == 2


@pytest.mark.parametrize("prompt", [["--prompt", "What is the capital of France?"], ["--prompt", "Hello", "--raw-prompt"],
                                    ["--prompt-ids", "5,17,300,42"]])
def test_greedy_json_equals_moemesh_run(services, tiny_model_dir, prompt):
    args = [*prompt, "--max-new-tokens", "12"]
    assert_same_generation(generate_json(services["router"], *args), run_json("--model", str(tiny_model_dir), *args))


def test_32_concurrent_streams_complete_with_correct_results(services, tiny_model_dir):
    from moemesh.engine import EngineConfig, LLMEngine, SamplingParams

    prompts = [[5 + i, 40 + 3 * i, 100 + i] for i in range(32)]
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model_dir), max_num_seqs=1))
    expected = [r.token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))]

    async def main():
        async with grpc.aio.insecure_channel(services["router"]) as ch:
            stub = gen_grpc.GenerationStub(ch)

            async def one(p):
                req = build_request(prompt_token_ids=p, max_new_tokens=8, temperature=0.0, ignore_eos=True)
                return [t async for r in stub.Generate(req, timeout=120) for t in r.token_ids]

            return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(main()) == expected
    assert wait_idle(services["attention"]).running == 0


@pytest.mark.parametrize(
    "kw, code, field",
    [
        ({"prompt": ""}, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        ({"prompt_token_ids": []}, grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
        ({"prompt_token_ids": [5] * 300}, grpc.StatusCode.OUT_OF_RANGE, "prompt_token_ids"),
        ({"prompt": "The quick brown fox jumps over the lazy dog. " * 30}, grpc.StatusCode.OUT_OF_RANGE, "prompt"),
        ({"prompt_token_ids": [5], "max_new_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
        ({"prompt_token_ids": [5], "max_new_tokens": 10_000}, grpc.StatusCode.OUT_OF_RANGE, "max_new_tokens"),
        ({"prompt_token_ids": [5], "temperature": -1.0}, grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        ({"prompt_token_ids": [5], "top_p": 0.0}, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        ({"prompt_token_ids": [5], "top_p": 1.01}, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        ({"prompt_token_ids": [5, 512]}, grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids[1]"),
        ({"prompt_token_ids": [-3]}, grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids[0]"),
        ({"prompt_token_ids": [5], "model": "no-such-model"}, grpc.StatusCode.NOT_FOUND, "model"),
        ({"messages": []}, grpc.StatusCode.INVALID_ARGUMENT, "messages"),
    ],
)
def test_bad_input_gets_the_right_status_and_the_router_keeps_serving(stub, kw, code, field):
    with pytest.raises(grpc.RpcError) as e:
        collect(stub, **kw)
    assert e.value.code() == code
    assert e.value.details().startswith(field), e.value.details()
    ok = collect(stub, prompt_token_ids=[5, 6], max_new_tokens=2)
    assert ok[-1].finish_reason in ("length", "stop")


def test_invalid_utf8_is_invalid_argument_naming_the_field(services):
    raw = build_request(prompt="ab").SerializeToString().replace(b"ab", b"\xff\xfe")
    with grpc.insecure_channel(services["router"]) as ch:
        call = ch.unary_stream("/moemesh.v1.Generation/Generate", request_serializer=None,
                               response_deserializer=gen_pb.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as e:
            list(call(raw, timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("prompt: not valid UTF-8")


def test_oversized_message_is_resource_exhausted(services):
    with grpc.insecure_channel(services["tight"]) as ch:
        stub = gen_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(build_request(prompt="x" * (2 << 20)), timeout=30))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        ok = list(stub.Generate(build_request(prompt_token_ids=[5], max_new_tokens=2), timeout=30))
        assert ok[-1].finish_reason


def test_full_router_refuses_with_resource_exhausted(services):
    with grpc.insecure_channel(services["tight"]) as ch:
        stub = gen_grpc.GenerationStub(ch)
        long = stub.Generate(build_request(prompt_token_ids=[5], max_new_tokens=250, ignore_eos=True), timeout=60)
        next(long)  # running: the router's only slot is taken
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(build_request(prompt_token_ids=[6], max_new_tokens=2), timeout=30))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        long.cancel()
    assert wait_idle(services["attention"]).free_blocks == wait_idle(services["attention"]).total_blocks


def test_client_cancel_frees_the_kv_blocks(services, stub):
    call = stub.Generate(build_request(prompt_token_ids=[5, 6, 7], max_new_tokens=250, ignore_eos=True), timeout=60)
    got = [next(call), next(call)]
    assert all(r.token_ids for r in got)
    call.cancel()
    load = wait_idle(services["attention"])
    assert (load.running, load.waiting, load.free_blocks) == (0, 0, load.total_blocks)


def test_deadline_frees_the_kv_blocks(services, stub):
    with pytest.raises(grpc.RpcError) as e:
        collect(stub, timeout=0.3, prompt_token_ids=[5, 6, 7], max_new_tokens=250, ignore_eos=True)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    load = wait_idle(services["attention"])
    assert (load.running, load.waiting, load.free_blocks) == (0, 0, load.total_blocks)


def test_abort_ends_the_stream_with_abort(stub):
    call = stub.Generate(build_request(request_id="to-abort", prompt_token_ids=[5], max_new_tokens=250, ignore_eos=True), timeout=60)
    next(call)
    assert stub.Abort(gen_pb.AbortRequest(request_id="to-abort"), timeout=10).found
    rest = list(call)
    assert rest[-1].finish_reason == "abort"
    assert not stub.Abort(gen_pb.AbortRequest(request_id="to-abort"), timeout=10).found


def test_a_request_id_is_reusable_right_after_a_client_cancel(stub):
    """Issue 16: ALREADY_EXISTS for up to ~1 s after a cancel."""
    for i in range(20):
        rid = f"reuse-{i}"
        call = stub.Generate(build_request(request_id=rid, prompt_token_ids=[5, 6], max_new_tokens=250, ignore_eos=True), timeout=60)
        next(call)
        call.cancel()
        again = collect(stub, request_id=rid, prompt_token_ids=[5, 6], max_new_tokens=2)
        assert again[-1].finish_reason in ("length", "stop")


def test_a_request_id_is_reusable_as_soon_as_abort_returns(stub):
    for i in range(20):
        rid = f"reabort-{i}"
        call = stub.Generate(build_request(request_id=rid, prompt_token_ids=[5], max_new_tokens=250, ignore_eos=True), timeout=60)
        next(call)
        assert stub.Abort(gen_pb.AbortRequest(request_id=rid), timeout=10).found
        again = collect(stub, request_id=rid, prompt_token_ids=[5, 6], max_new_tokens=2)
        assert again[-1].finish_reason in ("length", "stop")
        assert list(call)[-1].finish_reason == "abort"


def test_stop_string_truncates_and_stops(stub):
    full = collect(stub, prompt="Hello there", max_new_tokens=24, temperature=0.0, ignore_eos=True)
    text = "".join(r.text for r in full)
    stop = text[len(text) // 2: len(text) // 2 + 2]
    if not stop.strip():
        pytest.fail(f"generated text too short to pick a stop string: {text!r}")
    out = collect(stub, prompt="Hello there", max_new_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    assert "".join(r.text for r in out) == text[: text.index(stop)]
    assert out[-1].finish_reason == "stop"
