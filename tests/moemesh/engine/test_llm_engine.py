"""LLMEngine behaviour: continuous batching equals one-at-a-time, micro-batches, preemption, abort,
KV block accounting, stop tokens, seeds, MoE knobs changed between steps."""
from __future__ import annotations

import pytest
import torch

from moemesh.engine import EngineConfig, LLMEngine, SamplingParams

PROMPTS = [[5, 17, 301, 42, 9], [400, 2, 8, 77, 123, 250, 3, 64, 11, 45, 46], [99, 98], [7] * 9]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def engine(path, **kw):
    base = dict(block_size=4, kv_cache_tokens=512)
    base.update(kw)
    return LLMEngine(EngineConfig(str(path), **base))


def one_at_a_time(path, prompts, params):
    e = engine(path)
    return [e.generate([p], params)[0].token_ids for p in prompts]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_continuous_batching_equals_one_at_a_time(tiny_ckpt, arch):
    path, _ = tiny_ckpt(arch)
    expected = one_at_a_time(path, PROMPTS, GREEDY)
    e = engine(path)
    got: dict[str, list[int]] = {}
    e.add_request("a", PROMPTS[0], GREEDY)
    e.add_request("b", PROMPTS[1], GREEDY)
    steps = 0
    while e.has_unfinished() or steps < 4:
        if steps == 3:  # join while others are decoding
            e.add_request("c", PROMPTS[2], GREEDY)
            e.add_request("d", PROMPTS[3], GREEDY)
        for out in e.step():
            got.setdefault(out.request_id, []).append(out.token_id)
        steps += 1
    assert [got[k] for k in "abcd"] == expected
    assert e.num_free_blocks == e.kv.allocator.num_blocks


def test_two_micro_batches_equal_one(tiny_ckpt):
    path, _ = tiny_ckpt("qwen3_moe", mlp_only_layers=[0])
    one = engine(path).generate(PROMPTS, GREEDY)
    two = engine(path, micro_batches=2).generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in two] == [r.token_ids for r in one]


def test_preemption_under_a_small_cache_keeps_tokens(tiny_ckpt):
    path, _ = tiny_ckpt("mixtral")
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    expected = [r.token_ids for r in engine(path).generate(PROMPTS, params)]
    small = engine(path, kv_cache_tokens=48)  # 12 blocks of 4: not enough for all four to finish together
    got = [r.token_ids for r in small.generate(PROMPTS, params)]
    assert got == expected
    assert small.num_free_blocks == 12


def test_abort_frees_blocks_and_reports(tiny_ckpt):
    path, _ = tiny_ckpt("mixtral")
    e = engine(path)
    total = e.num_free_blocks
    e.add_request("x", PROMPTS[1], GREEDY)
    e.add_request("y", PROMPTS[0], GREEDY)
    e.step()
    assert e.num_free_blocks < total
    assert e.abort("x") and not e.abort("nope")
    outs = e.step()
    aborted = [o for o in outs if o.request_id == "x"]
    assert len(aborted) == 1 and aborted[0].finish_reason == "abort" and aborted[0].finished and aborted[0].token_id is None
    assert all(o.request_id != "x" for o in e.step())
    e.abort("y")
    e.step()
    assert not e.has_unfinished() and e.num_free_blocks == total


def test_abort_of_waiting_request(tiny_ckpt):
    path, _ = tiny_ckpt("mixtral")
    e = engine(path)
    e.add_request("w", PROMPTS[0], GREEDY)
    assert e.abort("w")
    assert [(o.request_id, o.finish_reason) for o in e.step()] == [("w", "abort")]
    assert not e.has_unfinished()


def test_stop_token_and_eos(tiny_ckpt):
    path, _ = tiny_ckpt("mixtral")
    e = engine(path)
    free = e.generate([PROMPTS[1]], GREEDY)[0].token_ids
    stop = free[4]
    first = free.index(stop)
    r = e.generate([PROMPTS[1]], SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(stop,), ignore_eos=True))[0]
    assert r.token_ids == free[: first + 1] and r.finish_reason == "stop"
    length = e.generate([PROMPTS[1]], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert length.finish_reason == "length" and len(length.token_ids) == 3


def test_seeded_sampling_does_not_depend_on_neighbours(tiny_ckpt):
    path, _ = tiny_ckpt("qwen3_moe")
    p = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    e = engine(path)
    alone = e.generate([PROMPTS[0]], p)[0].token_ids
    crowd = e.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [GREEDY, p, SamplingParams(temperature=0.8, seed=9, max_new_tokens=5)])
    assert crowd[1].token_ids == alone


def test_top_k_one_sampling_is_greedy(tiny_ckpt):
    path, _ = tiny_ckpt("mixtral")
    e = engine(path)
    greedy = e.generate([PROMPTS[1]], GREEDY)[0]
    sampled = e.generate([PROMPTS[1]], SamplingParams(max_new_tokens=12, temperature=1.3, top_k=1, seed=3, ignore_eos=True))[0]
    assert sampled.token_ids == greedy.token_ids
    assert sampled.logprobs == pytest.approx(greedy.logprobs, abs=1e-6)


def test_top_logprobs_only_for_the_requests_that_ask(tiny_ckpt):
    path, _ = tiny_ckpt("mixtral")
    e = engine(path)
    e.add_request("top", PROMPTS[0], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True, top_logprobs=4))
    e.add_request("plain", PROMPTS[1], GREEDY)
    seen = {"top": [], "plain": []}
    while e.has_unfinished():
        for out in e.step():
            if out.token_id is not None:
                seen[out.request_id].append(out)
    assert all(o.top_logprobs is None for o in seen["plain"])
    for o in seen["top"]:
        ids, lps = zip(*o.top_logprobs)
        assert len(ids) == 4 and list(lps) == sorted(lps, reverse=True)
        assert ids[0] == o.token_id and lps[0] == pytest.approx(o.logprob, abs=1e-6)  # greedy picks the most likely


def test_moe_knobs_between_steps_equal_a_fresh_engine(tiny_ckpt):
    path, _ = tiny_ckpt("mixtral")
    lp = SamplingParams(max_new_tokens=4, temperature=0.0, prompt_logprobs=True, ignore_eos=True)
    e = engine(path)
    before = e.generate([PROMPTS[1]], lp)[0]
    e.set_moe_knobs(top_k=4)
    after = e.generate([PROMPTS[1]], lp)[0]
    fresh = engine(path, moe_top_k=4).generate([PROMPTS[1]], lp)[0]
    assert after.prompt_logprobs == fresh.prompt_logprobs and after.token_ids == fresh.token_ids
    assert after.prompt_logprobs != pytest.approx(before.prompt_logprobs, abs=1e-4)
    e.set_moe_knobs(capacity_factor=0.25, layer=1)
    capped = e.generate([PROMPTS[1]], lp)[0]
    fresh_capped = engine(path, moe_top_k=4)
    fresh_capped.set_moe_knobs(capacity_factor=0.25, layer=1)
    assert capped.prompt_logprobs == fresh_capped.generate([PROMPTS[1]], lp)[0].prompt_logprobs
    assert capped.prompt_logprobs != pytest.approx(after.prompt_logprobs, abs=1e-4)


def test_knobs_change_mid_request_applies_from_next_step(tiny_ckpt):
    path, _ = tiny_ckpt("mixtral")
    e = engine(path)
    e.add_request("r", PROMPTS[0], GREEDY)
    e.step()
    e.set_moe_knobs(top_k=8)
    assert e.knobs.for_layer(0).top_k == 8
    while e.has_unfinished():
        e.step()
    with pytest.raises(ValueError, match="top_k"):
        e.set_moe_knobs(top_k=9)
    with pytest.raises(ValueError, match="layer 7"):
        e.set_moe_knobs(capacity_factor=1.0, layer=7)


def test_add_request_validation(tiny_ckpt):
    path, _ = tiny_ckpt("mixtral")
    e = engine(path)
    with pytest.raises(ValueError, match="max_new_tokens"):
        e.add_request("a", [1] * 250, SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        e.add_request("a", [], GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        e.add_request("a", [512], GREEDY)
    e.add_request("a", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        e.add_request("a", [1, 2], GREEDY)


def test_generate_is_all_or_nothing_on_bad_input(tiny_ckpt):
    path, _ = tiny_ckpt("mixtral")
    e = engine(path)
    with pytest.raises(ValueError, match="vocabulary"):
        e.generate([PROMPTS[0], [9999]], GREEDY)
    assert not e.has_unfinished() and e.num_free_blocks == e.kv.allocator.num_blocks


def test_packed_experts_equal_plain_in_bfloat16(tiny_ckpt):
    path, _ = tiny_ckpt("mixtral", num_experts_per_tok=4, num_local_experts=4)  # every token to every expert
    plain = engine(path, dtype="bfloat16").generate(PROMPTS, GREEDY)
    packed_engine = engine(path, dtype="bfloat16", pack_experts=True)
    packed = packed_engine.generate(PROMPTS, GREEDY)
    assert packed_engine.experts.layers[0].concatenated.gate_up.is_mkldnn == torch.backends.mkldnn.is_available()
    assert [r.token_ids for r in packed] == [r.token_ids for r in plain]
    assert [r.logprobs for r in packed] == [r.logprobs for r in plain]


def test_float32_with_two_threads_packs_for_onednn_and_keeps_the_tokens(tiny_ckpt):
    path, _ = tiny_ckpt("mixtral", num_experts_per_tok=4, num_local_experts=4, tie_word_embeddings=True)
    plain = engine(path, num_threads=1).generate(PROMPTS, GREEDY)
    packed_engine = engine(path, num_threads=2, pack_experts=True)
    packed = packed_engine.generate(PROMPTS, GREEDY)
    onednn = torch.backends.mkldnn.is_available()
    assert packed_engine.model.lm_head.is_mkldnn == onednn  # tied: a packed copy of the embedding
    assert not packed_engine.model.embed.is_mkldnn  # still indexable
    assert packed_engine.experts.layers[0].concatenated.gate_up.is_mkldnn == onednn
    assert [r.token_ids for r in packed] == [r.token_ids for r in plain]
    for a, b in zip(packed, plain):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_the_packed_expert_copy_is_built_by_default_only_when_every_token_goes_to_every_expert(tiny_ckpt):
    """A sparse model never takes the all-experts path, so auto never doubles its expert memory (nor
    holds the all-experts layout: its experts stay as loaded, as the compiled kernels read them)."""
    all_experts, _ = tiny_ckpt("mixtral", num_experts_per_tok=4, num_local_experts=4)
    sparse, _ = tiny_ckpt("mixtral", num_experts_per_tok=2, num_local_experts=4)
    packed = engine(all_experts, dtype="bfloat16").experts.layers[0].concatenated
    assert packed.gate_up.is_mkldnn == torch.backends.mkldnn.is_available()
    sparse_engine = engine(sparse, dtype="bfloat16")
    assert sparse_engine.experts.layers[0].concatenated is None
    sparse_engine.set_moe_knobs(top_k=4)  # a live top-k change to E still runs (through moe_mlp)
    assert sparse_engine.generate(PROMPTS, GREEDY)


def test_the_all_experts_path_is_a_config_switch_with_the_same_results(tiny_ckpt):
    path, _ = tiny_ckpt("mixtral", num_experts_per_tok=4, num_local_experts=4)  # every token to every expert
    on, off = engine(path), engine(path, all_experts_path=False)
    assert on.experts.layers[0].concatenated is not None and off.experts.layers[0].concatenated is None
    a, b = on.generate(PROMPTS, GREEDY), off.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)
