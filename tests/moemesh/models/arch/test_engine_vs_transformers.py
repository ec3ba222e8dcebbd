"""DeepSeek-V3, GLM-4.5 MoE and gpt-oss through LLMEngine vs transformers (fp32): prompt logprobs
within 1e-4, identical 32-token greedy continuations, and the generated tokens' logprobs (decode
steps over the paged cache) within 1e-4 of a full transformers forward."""
from __future__ import annotations

import pytest

from moemesh.engine.sampling_params import SamplingParams
from tests.moemesh.models.arch.conftest import GREEDY_TOKENS, PROMPTS, VARIANTS
from tests.moemesh.models.arch.engine_helpers import make_engine
from tests.moemesh.models.arch.reference import assert_logprobs_close, prompt_logprobs


@pytest.mark.parametrize("tiny_checkpoint", list(VARIANTS), indirect=True)
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_matches_transformers(tiny_checkpoint, micro_batches):
    path, ref, expected = tiny_checkpoint
    engine = make_engine(path, micro_batches=micro_batches)
    params = SamplingParams(max_new_tokens=GREEDY_TOKENS, temperature=0.0, prompt_logprobs=True, ignore_eos=True)
    for prompt, res in zip(PROMPTS, engine.generate([list(p) for p in PROMPTS], params)):
        ref_plp, ref_tokens = expected[prompt]
        assert_logprobs_close(res.prompt_logprobs, ref_plp)
        assert res.token_ids == ref_tokens
        full = prompt_logprobs(ref, list(prompt) + res.token_ids)[len(prompt):]
        assert max(abs(a - b) for a, b in zip(res.logprobs, full)) < 1e-4
