"""The check every newer family is held to through LLMEngine: prompt logprobs within 1e-4 of
transformers (float32), the same greedy continuation, and the generated tokens' logprobs (decode
steps over the cache) within 1e-4 of a full transformers forward."""
from __future__ import annotations

from moemesh.engine.sampling_params import SamplingParams
from tests.moemesh.models.arch.engine_helpers import make_engine
from tests.moemesh.models.arch.reference import assert_logprobs_close, prompt_logprobs
from tests.moemesh.models.tiny_families import GREEDY_TOKENS, PROMPTS


def run_prompts(engine, prompts, new_tokens: int = GREEDY_TOKENS):
    """Greedy, with prompt logprobs, all prompts batched together."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, prompt_logprobs=True, ignore_eos=True)
    return engine.generate([list(p) for p in prompts], params)


def check_engine_matches(checkpoint, **engine_kw) -> None:
    path, ref, expected = checkpoint
    engine = make_engine(path, **engine_kw)
    for prompt, res in zip(PROMPTS, run_prompts(engine, PROMPTS)):
        ref_plp, ref_tokens = expected[prompt]
        assert_logprobs_close(res.prompt_logprobs, ref_plp)
        assert res.token_ids == ref_tokens
        full = prompt_logprobs(ref, list(prompt) + res.token_ids)[len(prompt):]
        assert max(abs(a - b) for a, b in zip(res.logprobs, full)) < 1e-4
