"""`moemesh run --prompt-ids .. --json` in a subprocess vs transformers (float32) for each variant of the
newer families: the 70-token prompt (past every DSA variant's index_topk), 32 greedy
tokens."""
from __future__ import annotations

import pytest

from tests.moemesh.models.arch.reference import assert_logprobs_close
from tests.moemesh.models.arch.test_run_cli import moemesh_run
from tests.moemesh.models.tiny_families import PROMPTS

pytestmark = pytest.mark.slow

SERVED = ["deepseek_v32", "deepseek_v32_plain", "glm_moe_dsa", "glm_moe_dsa_pattern", "minimax_m2",
          "minimax_m2_full_rope", "kimi_k25", "kimi_k25_published", "qwen3_next", "qwen3_next_plain", "qwen3_5_moe",
          "qwen3_5_moe_vl"]


@pytest.mark.parametrize("family_checkpoint", SERVED, indirect=True)
def test_run_matches_transformers(family_checkpoint):
    path, _, expected = family_checkpoint
    prompt = PROMPTS[2]
    out = moemesh_run(path, prompt)
    ref_plp, ref_tokens = expected[prompt]
    assert out["prompt_token_ids"] == list(prompt)
    assert_logprobs_close(out["prompt_logprobs"], ref_plp)
    assert out["token_ids"] == ref_tokens
    assert out["finish_reason"] == "length"
