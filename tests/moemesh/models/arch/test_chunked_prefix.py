"""DeepSeek-V3 (MLA latent cache), GLM-4.5 MoE and gpt-oss (sinks, sliding layers) with prefix caching
and chunked prefill (float32): prompt logprobs computed in chunks within 1e-4 of transformers with the
same greedy tokens, and a shared-prefix workload with sequences joining and leaving gives what each
prompt gives alone on an engine without the cache or chunks."""
from __future__ import annotations

import pytest

from moemesh.engine.sampling_params import SamplingParams
from tests.fixtures.shared_prefix import JOINS, alone, answer_of, assert_same, shared_prefix_prompts, staggered
from tests.moemesh.models.arch.conftest import GREEDY_TOKENS, PROMPTS, VARIANTS
from tests.moemesh.models.arch.engine_helpers import make_engine
from tests.moemesh.models.arch.reference import assert_logprobs_close


@pytest.mark.parametrize("tiny_checkpoint", list(VARIANTS), indirect=True)
def test_chunked_prompt_matches_transformers(tiny_checkpoint):
    path, _, expected = tiny_checkpoint
    engine = make_engine(path, max_num_seqs=4, max_num_batched_tokens=5)  # 11-token prompt: chunks of 5, 5, 1
    params = SamplingParams(max_new_tokens=GREEDY_TOKENS, temperature=0.0, prompt_logprobs=True, ignore_eos=True)
    for prompt, res in zip(PROMPTS, engine.generate([list(p) for p in PROMPTS], params)):
        ref_plp, ref_tokens = expected[prompt]
        assert_logprobs_close(res.prompt_logprobs, ref_plp)
        assert res.token_ids == ref_tokens


@pytest.mark.parametrize("tiny_checkpoint", list(VARIANTS), indirect=True)
def test_prefix_cache_and_chunks_change_nothing(tiny_checkpoint):
    path, _, _ = tiny_checkpoint
    plain = make_engine(path, prefix_cache=False)
    prompts = shared_prefix_prompts(answer=answer_of(plain, shared_prefix_prompts()))
    expected = alone(plain, prompts)
    engine = make_engine(path, max_num_seqs=8, max_num_batched_tokens=8)
    got = staggered(engine, prompts, JOINS)
    assert_same(got, expected)
    assert got["b"]["cached_tokens"] == 16 and got["c"]["cached_tokens"] == 20
