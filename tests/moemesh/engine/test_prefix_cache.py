"""Prefix caching and chunked prefill through LLMEngine (Mixtral, Mixtral with a sliding window,
Qwen3-MoE; float32): the same greedy tokens and logprobs as each prompt alone on an engine without
either, with sequences joining and leaving, under KV pressure (preemption with shared blocks), with
two micro-batches; usage reports the cached tokens."""
from __future__ import annotations

import pytest

from moemesh.engine import EngineConfig, LLMEngine, SamplingParams
from tests.fixtures.shared_prefix import JOINS, alone, answer_of, assert_same, shared_prefix_prompts, staggered

MODELS = {"mixtral": ("mixtral", {}), "mixtral_window": ("mixtral", {"sliding_window": 6}), "qwen3_moe": ("qwen3_moe", {})}


def engine(path, **kw) -> LLMEngine:
    base = dict(block_size=4, kv_cache_tokens=512, max_num_seqs=8)
    base.update(kw)
    return LLMEngine(EngineConfig(str(path), **base))


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    """model name -> (path, prompts, each prompt alone without prefix cache or chunks)."""
    built = {}

    def get(name):
        if name not in built:
            arch, overrides = MODELS[name]
            path, _ = tiny_ckpt(arch, **overrides)
            plain = engine(path, prefix_cache=False)
            prompts = shared_prefix_prompts(answer=answer_of(plain, shared_prefix_prompts()))
            built[name] = (path, prompts, alone(plain, prompts))
        return built[name]

    return get


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("prefix_cache, budget", [(True, 8), (False, 8), (True, 4096)])
def test_outputs_do_not_change_with_the_cache_or_chunks(reference, name, prefix_cache, budget):
    path, prompts, expected = reference(name)
    e = engine(path, prefix_cache=prefix_cache, max_num_batched_tokens=budget)
    got = staggered(e, prompts, JOINS)
    assert_same(got, expected)
    cached = {rid: g["cached_tokens"] for rid, g in got.items()}
    if prefix_cache:
        assert cached["b"] == 16 and cached["c"] == 20 and cached["e"] >= 28
        assert cached["a"] == cached["d"] == cached["f"] == 0  # f asks for prompt logprobs: no lookup
        assert e.stats.prefix_hits == 16 + 20 + cached["e"]
    else:
        assert set(cached.values()) == {0} and e.stats.prefix_queries == 0
    assert not e.has_unfinished() and e.num_free_blocks == e.kv.allocator.num_blocks


def test_two_micro_batches_with_chunks_and_hits(reference):
    path, prompts, expected = reference("qwen3_moe")
    assert_same(staggered(engine(path, max_num_batched_tokens=8, micro_batches=2), prompts, JOINS), expected)


def test_preemption_with_shared_blocks_keeps_outputs(reference):
    path, prompts, expected = reference("mixtral")
    e = engine(path, kv_cache_tokens=64, max_num_batched_tokens=8)  # 16 blocks: the six cannot all run at once
    got = staggered(e, prompts, {0: ["a"], 3: ["b", "c", "d", "e", "f"]})
    assert_same(got, expected)
    assert e.stats.preemptions > 0
    assert e.num_free_blocks == 16


def test_a_prompt_longer_than_the_budget_is_served(reference):
    path, _, _ = reference("mixtral")
    prompt = list(range(10, 210))  # 200 tokens, budget 16, context 256
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=True)
    whole = engine(path, prefix_cache=False, max_num_batched_tokens=256).generate([prompt], params)[0]
    chunked = engine(path, max_num_batched_tokens=16).generate([prompt], params)[0]
    assert chunked.token_ids == whole.token_ids
    assert chunked.prompt_logprobs[1:] == pytest.approx(whole.prompt_logprobs[1:], abs=1e-4)


def test_abort_mid_prompt_releases_every_block(reference):
    path, prompts, _ = reference("mixtral")
    e = engine(path, max_num_batched_tokens=8)
    e.add_request("d", prompts["d"], SamplingParams(max_new_tokens=4))
    e.step()
    e.step()
    assert e.num_free_blocks < e.kv.allocator.num_blocks
    assert e.abort("d")
    assert [o.finish_reason for o in e.step()] == ["abort"]
    assert e.num_free_blocks == e.kv.allocator.num_blocks
    assert e.kv.allocator.num_cached == 4  # its 4 computed full blocks (16 tokens) stay for later prompts


def test_a_model_without_prefix_cache_support_runs_without_it(tiny_ckpt, monkeypatch):
    from moemesh.models.mixtral import MixtralForCausalLM

    path, _ = tiny_ckpt("mixtral")
    monkeypatch.setattr(MixtralForCausalLM, "supports_prefix_cache", False, raising=False)
    e = engine(path)
    assert not e.prefix_caching and not e.kv.allocator.caching
    prompt = list(range(20, 40))
    e.generate([prompt], SamplingParams(max_new_tokens=2, temperature=0.0))
    assert e.generate([prompt], SamplingParams(max_new_tokens=2, temperature=0.0))[0].cached_tokens == 0
