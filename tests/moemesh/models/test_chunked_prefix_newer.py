"""The newer families with prefix caching and chunked prefill (float32), against transformers: prompt
logprobs computed in chunks (the 70-token prompt past every DSA variant's index_topk, in chunks of 24),
and a shared-prefix workload with sequences joining and leaving, cache hits (DSA: indexer keys of
cached blocks scored with the chunk's own), preemption and two micro-batches. The hybrid models
(recurrent state per sequence) are in qwen3_next/test_engine.py."""
from __future__ import annotations

import pytest

from moemesh.engine.sampling_params import SamplingParams
from tests.moemesh.models.arch.engine_helpers import make_engine
from tests.moemesh.models.arch.reference import assert_logprobs_close
from tests.moemesh.models.engine_vs_transformers import check_staggered
from tests.moemesh.models.tiny_families import GREEDY_TOKENS, PROMPTS

DSA = ["deepseek_v32", "deepseek_v32_plain", "glm_moe_dsa", "glm_moe_dsa_pattern"]
CACHED = DSA + ["minimax_m2", "kimi_k25"]


@pytest.mark.parametrize("family_checkpoint", CACHED, indirect=True)
def test_chunked_prompts_match_transformers(family_checkpoint):
    path, _, expected = family_checkpoint
    engine = make_engine(path, max_num_seqs=4, max_num_batched_tokens=24)
    params = SamplingParams(max_new_tokens=GREEDY_TOKENS, temperature=0.0, prompt_logprobs=True, ignore_eos=True)
    for prompt, res in zip(PROMPTS, engine.generate([list(p) for p in PROMPTS], params)):
        ref_plp, ref_tokens = expected[prompt]
        assert_logprobs_close(res.prompt_logprobs, ref_plp)
        assert res.token_ids == ref_tokens


@pytest.mark.parametrize("family_checkpoint", CACHED, indirect=True)
def test_prefix_cache_and_chunks_match_transformers(family_checkpoint):
    engine, got = check_staggered(family_checkpoint, max_num_batched_tokens=8)
    assert got["b"]["cached_tokens"] == 16 and got["c"]["cached_tokens"] == 20 and got["e"]["cached_tokens"] >= 28


@pytest.mark.parametrize("family_checkpoint", ["deepseek_v32", "glm_moe_dsa"], indirect=True)
def test_preemption_and_two_micro_batches_with_hits_match_transformers(family_checkpoint):
    engine, _ = check_staggered(family_checkpoint, {0: ["a"], 3: ["b", "c", "d", "e", "f"]},
                                kv_cache_tokens=64, max_num_batched_tokens=8)  # 16 blocks: the six cannot all run
    assert engine.stats.preemptions > 0 and engine.stats.prefix_hits > 0
    check_staggered(family_checkpoint, max_num_batched_tokens=8, micro_batches=2)
