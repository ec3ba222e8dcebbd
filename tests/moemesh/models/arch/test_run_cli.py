"""`moemesh run --prompt-ids .. --json` in a subprocess vs transformers, for each architecture (float
checkpoints) and each native quantized layout (vs transformers on the dequantized weights)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers as tf

from tests.moemesh.models.arch.conftest import GREEDY_TOKENS, NATIVE, PROMPTS
from tests.moemesh.models.arch.reference import assert_logprobs_close, greedy, prompt_logprobs


pytestmark = pytest.mark.slow

def moemesh_run(model_dir, prompt) -> dict:
    cmd = [sys.executable, "-m", "moemesh.cli.main", "run", "--model", str(model_dir), "--prompt-ids",
           ",".join(map(str, prompt)), "--max-new-tokens", str(GREEDY_TOKENS), "--dtype", "float32", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tiny_checkpoint", ["deepseek_v3", "glm4_moe", "gpt_oss"], indirect=True)
def test_run_matches_transformers(tiny_checkpoint):
    path, _, expected = tiny_checkpoint
    prompt = PROMPTS[0]
    out = moemesh_run(path, prompt)
    ref_plp, ref_tokens = expected[prompt]
    assert out["prompt_token_ids"] == list(prompt)
    assert_logprobs_close(out["prompt_logprobs"], ref_plp)
    assert out["token_ids"] == ref_tokens
    assert out["finish_reason"] == "length"


@pytest.mark.parametrize("native_checkpoint", list(NATIVE), indirect=True)
def test_run_quantized_matches_dequantized_reference(native_checkpoint):
    _, qdir, deq_dir, _, _ = native_checkpoint
    ref = tf.AutoModelForCausalLM.from_pretrained(deq_dir, dtype=torch.float32).eval()
    prompt = list(PROMPTS[0])
    out = moemesh_run(qdir, prompt)
    assert_logprobs_close(out["prompt_logprobs"], prompt_logprobs(ref, prompt))
    assert out["token_ids"] == greedy(ref, prompt, GREEDY_TOKENS)
