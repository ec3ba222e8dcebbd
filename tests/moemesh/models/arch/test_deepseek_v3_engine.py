"""DeepseekV3ForCausalLM through the engine vs transformers: prompt logprobs and greedy continuations."""
from __future__ import annotations

from moemesh.engine.config import EngineConfig
from moemesh.engine.llm_engine import LLMEngine
from moemesh.engine.sampling_params import SamplingParams
from tests.moemesh.models.arch.reference import assert_logprobs_close, greedy, prompt_logprobs

PROMPTS = [[5, 17, 301, 42, 9, 77, 123, 250, 3, 64, 11], [400, 2, 2, 2, 99]]


def test_prompt_logprobs_and_greedy_match_transformers(deepseek_ckpt):
    path, ref = deepseek_ckpt
    engine = LLMEngine(EngineConfig(model_dir=str(path), block_size=4, kv_cache_tokens=512))
    params = SamplingParams(max_new_tokens=32, temperature=0.0, prompt_logprobs=True, ignore_eos=True)
    results = engine.generate(PROMPTS, params)
    for prompt, res in zip(PROMPTS, results):
        assert_logprobs_close(res.prompt_logprobs, prompt_logprobs(ref, prompt))
        assert res.token_ids == greedy(ref, prompt, 32)
        # the generated tokens' logprobs come from decode steps (absorbed MLA over the latent cache)
        full = prompt_logprobs(ref, prompt + res.token_ids)[len(prompt):]
        assert max(abs(a - b) for a, b in zip(res.logprobs, full)) < 1e-4
