import asyncio

import pytest

import grpc

from moemesh.errors import MeshError
from router_svc.admission import Admission
from router_svc.replicas import Replica, ReplicaSet
from router_svc.router import Router
from router_svc.types import Delta, Finished, GenerationInput, SamplingSpec
from tests.router_svc.fakes import FakeAttention


def make_router(info, tokenizer, fake, max_running=4, max_queued=4):
    return Router(info, ReplicaSet([Replica("fake", fake)]), Admission(max_running, max_queued), tokenizer)


async def collect(router, req):
    return [item async for item in router.generate(req)]


def test_streams_deltas_then_final(info, tokenizer):
    ids = tokenizer.encode("Hello world! How are you")
    fake = FakeAttention(ids, prompt_logprobs=(None, -1.0))
    router = make_router(info, tokenizer, fake)
    items = asyncio.run(collect(router, GenerationInput(request_id="r1", prompt_token_ids=(5, 6))))
    deltas, final = items[:-1], items[-1]
    assert all(isinstance(d, Delta) for d in deltas)
    assert "".join(d.text for d in deltas) == "Hello world! How are you"
    assert [t for d in deltas for t in d.token_ids] == ids
    assert isinstance(final, Finished) and final.finish_reason == "length"
    assert final.prompt_token_ids == (5, 6) and final.completion_tokens == len(ids)
    assert final.prompt_logprobs == (None, -1.0)


def test_stop_string_ends_the_sequence_on_the_replica(info, tokenizer):
    ids = tokenizer.encode("Hello world! How are you")
    fake = FakeAttention(ids)
    router = make_router(info, tokenizer, fake)
    req = GenerationInput(request_id="r2", prompt_token_ids=(5,), stop=("How",))
    items = asyncio.run(collect(router, req))
    assert "".join(i.text for i in items if isinstance(i, Delta)) == "Hello world! "
    assert items[-1].finish_reason == "stop"
    assert fake.closed_early == ["r2"]  # the replica's stream was cancelled -> sequence freed


def test_client_leaving_early_closes_the_replica_stream(info, tokenizer):
    fake = FakeAttention(range(10, 30), delay_s=0.001)
    router = make_router(info, tokenizer, fake)

    async def main():
        agen = router.generate(GenerationInput(request_id="r3", prompt_token_ids=(5,)))
        await agen.__anext__()
        await agen.aclose()

    asyncio.run(main())
    assert fake.closed_early == ["r3"]
    assert router.replicas.replicas[0].inflight == 0
    assert router.admission.running == 0


def test_abort_reaches_the_replica(info, tokenizer):
    fake = FakeAttention(range(10, 200), delay_s=0.002)
    router = make_router(info, tokenizer, fake)

    async def main():
        task = asyncio.create_task(collect(router, GenerationInput(request_id="r4", prompt_token_ids=(5,))))
        await asyncio.sleep(0.02)
        assert await router.abort("r4") is True
        assert await router.abort("nope") is False
        return await task

    items = asyncio.run(main())
    assert items[-1].finish_reason == "abort"
    assert fake.aborted == ["r4"]


def test_duplicate_running_request_id_is_refused(info, tokenizer):
    fake = FakeAttention(range(10, 2000), delay_s=0.002)  # runs past the grace a new call with its id waits
    router = make_router(info, tokenizer, fake)

    async def main():
        task = asyncio.create_task(collect(router, GenerationInput(request_id="dup", prompt_token_ids=(5,))))
        await asyncio.sleep(0.01)
        with pytest.raises(MeshError) as e:
            await collect(router, GenerationInput(request_id="dup", prompt_token_ids=(5,)))
        await router.abort("dup")
        await task
        return e.value

    assert asyncio.run(main()).code == grpc.StatusCode.ALREADY_EXISTS


def test_stream_without_finish_is_unavailable(info, tokenizer):
    fake = FakeAttention([10, 11], finish_reason="")
    router = make_router(info, tokenizer, fake)
    with pytest.raises(MeshError) as e:
        asyncio.run(collect(router, GenerationInput(prompt_token_ids=(5,))))
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_sampling_reaches_the_replica(info, tokenizer):
    fake = FakeAttention([10])
    router = make_router(info, tokenizer, fake)
    s = SamplingSpec(max_new_tokens=3, temperature=0.0, top_p=0.9, top_k=5, seed=1, logprobs=True, ignore_eos=True)
    asyncio.run(collect(router, GenerationInput(prompt_token_ids=(5,), sampling=s)))
    assert fake.specs[0].sampling == s


def test_sequences_spread_over_replicas(info, tokenizer):
    a, b = FakeAttention(range(10, 30), delay_s=0.001), FakeAttention(range(10, 30), delay_s=0.001)
    router = Router(info, ReplicaSet([Replica("a", a), Replica("b", b)]), Admission(8, 8), tokenizer)

    async def main():
        await asyncio.gather(*(collect(router, GenerationInput(prompt_token_ids=(5,))) for _ in range(6)))

    asyncio.run(main())
    assert (len(a.specs), len(b.specs)) == (3, 3)


def test_unavailable_replica_before_the_first_token_is_skipped(info, tokenizer):
    from tests.router_svc.fakes import DownAttention

    down, up = DownAttention([], address="down"), FakeAttention([10, 11], address="up")
    replicas = ReplicaSet([Replica("down", down), Replica("up", up)])
    router = Router(info, replicas, Admission(4, 4), tokenizer)
    for _ in range(3):
        items = asyncio.run(collect(router, GenerationInput(prompt_token_ids=(5,))))
        assert items[-1].finish_reason == "length"
    assert len(down.specs) <= 1 and len(up.specs) == 3
    assert not replicas.replicas[0].available


def test_all_replicas_unavailable_is_unavailable(info, tokenizer):
    from tests.router_svc.fakes import DownAttention

    router = Router(info, ReplicaSet([Replica("a", DownAttention([], address="a")), Replica("b", DownAttention([], address="b"))]),
                    Admission(4, 4), tokenizer)
    with pytest.raises(MeshError) as e:
        asyncio.run(collect(router, GenerationInput(prompt_token_ids=(5,))))
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_an_aborted_request_id_is_free_as_soon_as_abort_returns(info, tokenizer):
    fake = FakeAttention(range(10, 200), delay_s=0.005)
    router = make_router(info, tokenizer, fake)

    async def main():
        first = asyncio.create_task(collect(router, GenerationInput(request_id="x", prompt_token_ids=(5,))))
        await asyncio.sleep(0.03)
        assert await router.abort("x") is True
        second = asyncio.create_task(collect(router, GenerationInput(request_id="x", prompt_token_ids=(5,))))
        first_items = await first  # ending the first must not free the second's id
        await asyncio.sleep(0.03)
        assert await router.abort("x") is True
        return first_items, await second

    first, second = asyncio.run(main())
    assert first[-1].finish_reason == "abort" and second[-1].finish_reason == "abort"
    assert router._placed == {}


@pytest.mark.parametrize("code, message", [
    (grpc.StatusCode.INTERNAL, "logits: the model computed NaN or infinite logits for this sequence"),
    (grpc.StatusCode.INVALID_ARGUMENT, "temperature: must be a finite number >= 0"),
])
def test_a_sequence_failing_alone_does_not_mark_its_replica_unavailable(info, tokenizer, code, message):
    """Only UNAVAILABLE (a replica going away, a failed expert call) takes a replica out of rotation."""
    class Failing(FakeAttention):
        async def generate(self, spec, timeout):
            raise MeshError(code, message)
            yield

    replicas = ReplicaSet([Replica("a", Failing([], address="a")), Replica("b", FakeAttention([10, 11], address="b"))])
    router = Router(info, replicas, Admission(4, 4), tokenizer)
    with pytest.raises(MeshError) as e:
        asyncio.run(collect(router, GenerationInput(prompt_token_ids=(5,))))
    assert (e.value.code, e.value.message) == (code, message)
    assert all(r.available for r in replicas.replicas)
