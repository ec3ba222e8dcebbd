"""Qwen3-Next and Qwen3.5-MoE (text, and a VL checkpoint's text model) through LLMEngine against
transformers (float32), with the recurrent state held per sequence in the engine's slots: all prompts
batched (the 70-token prompt scans two delta-rule chunks), with two micro-batches, in prompt chunks
carrying the state across steps, with sequences joining and leaving (slots reused without clearing),
under preemption (recomputed from position 0), and after an abort. Prefix caching is off for these
models: the workload's shared prefixes never hit."""
from __future__ import annotations

import pytest

from moemesh.engine.sampling_params import SamplingParams
from tests.moemesh.models.arch.engine_helpers import make_engine
from tests.moemesh.models.arch.reference import assert_logprobs_close, prompt_logprobs
from tests.moemesh.models.engine_vs_transformers import check_engine_matches, check_staggered, run_prompts
from tests.moemesh.models.tiny_families import GREEDY_TOKENS, PROMPTS

HYBRID = ["qwen3_next", "qwen3_next_plain", "qwen3_5_moe", "qwen3_5_moe_vl"]


@pytest.mark.parametrize("family_checkpoint", HYBRID, indirect=True)
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_matches_transformers(family_checkpoint, micro_batches):
    check_engine_matches(family_checkpoint, micro_batches=micro_batches)


@pytest.mark.parametrize("family_checkpoint", HYBRID, indirect=True)
def test_chunks_carry_the_state_and_the_cache_is_off(family_checkpoint):
    path, _, expected = family_checkpoint
    engine = make_engine(path, max_num_seqs=4, max_num_batched_tokens=24)  # 70 tokens: chunks of 24, 24, 22
    assert not engine.prefix_caching
    for prompt, res in zip(PROMPTS, run_prompts(engine, PROMPTS)):
        ref_plp, ref_tokens = expected[prompt]
        assert_logprobs_close(res.prompt_logprobs, ref_plp)
        assert res.token_ids == ref_tokens
    _, got = check_staggered(family_checkpoint, max_num_batched_tokens=8)
    assert {g["cached_tokens"] for g in got.values()} == {0}


@pytest.mark.parametrize("family_checkpoint", ["qwen3_next", "qwen3_5_moe"], indirect=True)
def test_preemption_slot_reuse_and_two_micro_batches(family_checkpoint):
    engine, _ = check_staggered(family_checkpoint, {0: ["a"], 3: ["b", "c", "d", "e", "f"]},
                                kv_cache_tokens=64, max_num_batched_tokens=8)  # 16 blocks: the six cannot all run
    assert engine.stats.preemptions > 0
    check_staggered(family_checkpoint, max_num_seqs=2, max_num_batched_tokens=8)  # two slots, taken dirty in turn
    check_staggered(family_checkpoint, max_num_batched_tokens=8, micro_batches=2)


@pytest.mark.parametrize("family_checkpoint", ["qwen3_next"], indirect=True)
def test_abort_gives_the_slot_back_and_the_next_sequence_starts_clean(family_checkpoint):
    path, ref, expected = family_checkpoint
    engine = make_engine(path, max_num_seqs=1, max_num_batched_tokens=8)
    engine.add_request("x", list(PROMPTS[2]), SamplingParams(max_new_tokens=4))
    engine.step()  # its first chunk: the slot holds state now
    assert engine.state.slots.num_free == 0
    assert engine.abort("x")
    assert [o.finish_reason for o in engine.step()] == ["abort"]
    assert engine.state.slots.num_free == 1 and engine.num_free_blocks == engine.kv.allocator.num_blocks
    res = run_prompts(engine, PROMPTS[:1])[0]  # the only slot, as x left it
    ref_plp, ref_tokens = expected[PROMPTS[0]]
    assert_logprobs_close(res.prompt_logprobs, ref_plp)
    assert res.token_ids == ref_tokens


@pytest.mark.parametrize("family_checkpoint", ["qwen3_next"], indirect=True)
def test_kv_blocks_only_for_the_attention_layers(family_checkpoint):
    path, _, _ = family_checkpoint
    engine = make_engine(path)
    linear = engine.model.recurrent_state_spec().layers
    assert linear == (0, 1, 2)  # three Gated DeltaNet layers, then gated attention
    assert [kv is None for kv in engine.kv.layers] == [True, True, True, False]
    assert sorted(engine.state.layers) == [0, 1, 2]
