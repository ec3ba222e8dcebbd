import asyncio
import math

import pytest

from attention_svc.replica import AttentionReplica, SequenceRequest
from attention_svc.step_loop import StepLoop
from moemesh.engine import EngineConfig, LLMEngine, SamplingParams
from moemesh.errors import MeshError


def make_engine(model_dir, **kw):
    return LLMEngine(EngineConfig(model_dir=str(model_dir), kv_cache_tokens=512, **kw))


async def with_replica(engine, body):
    replica = AttentionReplica(engine, StepLoop(engine))
    task = asyncio.create_task(replica.loop.run())
    try:
        return await body(replica)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        replica.loop.close()


async def tokens_of(replica, req):
    return [out async for out in replica.generate(req)]


def test_concurrent_sequences_match_the_engine(tiny_model_dir):
    engine = make_engine(tiny_model_dir, micro_batches=2)
    prompts = [(5, 6, 7), (8, 9), (10, 11, 12, 13), (14,)]
    expected = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0))

    async def body(replica):
        reqs = [SequenceRequest(f"r{i}", p, {"max_new_tokens": 6, "temperature": 0.0}) for i, p in enumerate(prompts)]
        return await asyncio.gather(*(tokens_of(replica, r) for r in reqs))

    results = asyncio.run(with_replica(engine, body))
    for outs, exp in zip(results, expected):
        assert [o.token_id for o in outs] == exp.token_ids
        assert outs[-1].finished and outs[-1].finish_reason == exp.finish_reason
    assert engine.num_free_blocks == engine.kv.allocator.num_blocks


def test_leaving_early_frees_the_kv_blocks(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    total = engine.kv.allocator.num_blocks

    async def body(replica):
        agen = replica.generate(SequenceRequest("c", (5, 6, 7), {"max_new_tokens": 100, "temperature": 0.0, "ignore_eos": True}))
        await agen.__anext__()
        await agen.__anext__()
        assert engine.num_free_blocks < total
        await agen.aclose()
        for _ in range(100):
            if engine.num_free_blocks == total and not engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        return replica.load()

    load = asyncio.run(with_replica(engine, body))
    assert engine.num_free_blocks == total
    assert (load.waiting, load.running, load.free_blocks) == (0, 0, total)


def test_abort_ends_the_stream_with_abort(tiny_model_dir):
    engine = make_engine(tiny_model_dir)

    async def body(replica):
        outs = []
        async for out in replica.generate(SequenceRequest("a", (5, 6), {"max_new_tokens": 100, "ignore_eos": True})):
            outs.append(out)
            if len(outs) == 2:
                assert replica.abort("a") is True
        assert replica.abort("a") is False
        for _ in range(100):  # the stream ended at once; the engine frees the blocks at the loop's next turn
            if engine.num_free_blocks == engine.kv.allocator.num_blocks and not engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        return outs

    outs = asyncio.run(with_replica(engine, body))
    assert outs[-1].finish_reason == "abort"
    assert engine.num_free_blocks == engine.kv.allocator.num_blocks


@pytest.mark.parametrize(
    "prompt, sampling, code, field",
    [
        ((), {}, "INVALID_ARGUMENT", "prompt_token_ids"),
        ((5,) * 256, {}, "OUT_OF_RANGE", "prompt_token_ids"),
        ((5,), {"max_new_tokens": 300}, "OUT_OF_RANGE", "max_new_tokens"),
        ((5,), {"max_new_tokens": 0}, "INVALID_ARGUMENT", "max_new_tokens"),
        ((5,), {"temperature": -1.0}, "INVALID_ARGUMENT", "temperature"),
        ((5,), {"top_p": 1.5}, "INVALID_ARGUMENT", "top_p"),
        ((5, 9999), {}, "INVALID_ARGUMENT", "prompt_token_ids[1]"),
        ((5,), {"temperature": math.nan}, "INVALID_ARGUMENT", "temperature"),
        ((5,), {"temperature": math.inf}, "INVALID_ARGUMENT", "temperature"),
        ((5,), {"top_p": math.nan}, "INVALID_ARGUMENT", "top_p"),
        ((5,), {"top_p": -math.inf}, "INVALID_ARGUMENT", "top_p"),
    ],
)
def test_bad_sequences_are_refused_and_the_replica_keeps_serving(tiny_model_dir, prompt, sampling, code, field):
    engine = make_engine(tiny_model_dir)

    async def body(replica):
        with pytest.raises(MeshError) as e:
            await tokens_of(replica, SequenceRequest("bad", prompt, sampling))
        good = await tokens_of(replica, SequenceRequest("good", (5,), {"max_new_tokens": 2, "ignore_eos": True}))
        return e.value, good

    err, good = asyncio.run(with_replica(engine, body))
    assert err.code.name == code and err.message.startswith(field), err.message
    assert len(good) == 2 and good[-1].finished


def test_unset_max_new_tokens_is_capped_by_the_context(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    replica = AttentionReplica(engine, StepLoop(engine))
    params = replica.sampling_params(SequenceRequest("x", (5,) * 250, {}))
    assert params.max_new_tokens == 256 - 250
    replica.loop.close()


def test_underflowing_sampling_values_are_greedy_and_fail_nobody(tiny_model_dir):
    """Issue 16: temperature 1e-300 (or top_p 1e-300) used to fail every stream batched with it."""
    engine = make_engine(tiny_model_dir)
    greedy = engine.generate([(5, 6, 7)], SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids

    async def body(replica):
        reqs = [SequenceRequest("tiny-t", (5, 6, 7), {"max_new_tokens": 6, "temperature": 1e-300, "ignore_eos": True}),
                SequenceRequest("tiny-p", (5, 6, 7), {"max_new_tokens": 6, "top_p": 1e-300, "seed": 4, "ignore_eos": True}),
                SequenceRequest("mate", (8, 9), {"max_new_tokens": 6, "temperature": 0.9, "seed": 2, "ignore_eos": True})]
        return await asyncio.gather(*(tokens_of(replica, r) for r in reqs))

    tiny_t, tiny_p, mate = asyncio.run(with_replica(engine, body))
    assert [o.token_id for o in tiny_t] == greedy and [o.token_id for o in tiny_p] == greedy
    assert len(mate) == 6 and mate[-1].finish_reason == "length"
