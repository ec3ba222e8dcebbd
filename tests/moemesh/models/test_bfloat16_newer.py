"""bfloat16 compute for the newer families stays close to transformers in bfloat16 (each implementation
rounds differently, so only closeness is asked; float32 is held to 1e-4 elsewhere). The bound is on the
mean over the prompt: in DSA a rounding difference can swap a key in or out of a query's top-k and move
that token's logprob by a few tenths (transformers' own bfloat16 and float32 runs differ so too)."""
from __future__ import annotations

import copy

import pytest
import torch

from moemesh.engine.sampling_params import SamplingParams
from tests.moemesh.models.arch.engine_helpers import make_engine
from tests.moemesh.models.arch.reference import prompt_logprobs
from tests.moemesh.models.qwen3_next.driver import Driver
from tests.moemesh.models.tiny_families import PROMPTS

PROMPT = list(PROMPTS[2])


def assert_close_to_bf16_reference(got, ref_model):
    want = prompt_logprobs(copy.deepcopy(ref_model).to(torch.bfloat16), PROMPT)
    diffs = [abs(a - b) for a, b in zip(got[1:], want[1:])]
    assert sum(diffs) / len(diffs) < 0.05


@pytest.mark.parametrize("family_checkpoint", ["deepseek_v32", "glm_moe_dsa", "minimax_m2", "kimi_k25"], indirect=True)
def test_engine_bfloat16(family_checkpoint):
    path, ref, _ = family_checkpoint
    out = make_engine(path, dtype="bfloat16").generate(
        [PROMPT], SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=True, ignore_eos=True))[0]
    assert_close_to_bf16_reference(out.prompt_logprobs, ref)


@pytest.mark.parametrize("family_checkpoint", ["qwen3_next", "qwen3_5_moe"], indirect=True)
def test_hybrid_bfloat16(family_checkpoint):
    path, ref, _ = family_checkpoint
    drv = Driver(path, dtype=torch.bfloat16)
    drv.add("p", PROMPT)
    drv.step()
    assert_close_to_bf16_reference(drv.seqs["p"].prompt_logprobs, ref)
