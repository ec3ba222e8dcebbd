"""Model-level details: non-expert weight bytes per step, and a top-k knob above what the kept
groups hold widens the groups instead of failing the step."""
from __future__ import annotations

import copy

import pytest
import torch
from safetensors import safe_open

from moemesh.engine.sampling_params import SamplingParams
from tests.moemesh.models.arch.engine_helpers import make_engine
from tests.moemesh.models.arch.reference import greedy, prompt_logprobs
from moemesh.models.deepseek_v3.config import GroupedGateConfig
from moemesh.models.deepseek_v3.moe import groups_for


@pytest.mark.parametrize("tiny_checkpoint", ["deepseek_v3", "glm4_moe", "gpt_oss"], indirect=True)
def test_weight_bytes_are_the_non_expert_tensors_but_the_embedding(tiny_checkpoint):
    path, _, _ = tiny_checkpoint
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        want = sum(f.get_tensor(k).nbytes for k in f.keys() if "mlp.experts" not in k and "embed_tokens" not in k)
    assert make_engine(path).model.weight_bytes() == want


def test_groups_widen_only_when_top_k_needs_them():
    gate = GroupedGateConfig(n_group=4, topk_group=2, routed_scaling_factor=1.0, n_shared_experts=1, first_k_dense_replace=0)
    assert [groups_for(k, 16, gate) for k in (1, 8, 9, 12, 13, 16)] == [2, 2, 3, 3, 4, 4]


@pytest.mark.parametrize("tiny_checkpoint", ["deepseek_v3"], indirect=True)
def test_top_k_knob_beyond_kept_groups_runs(tiny_checkpoint):
    path, ref, _ = tiny_checkpoint
    engine = make_engine(path, moe_top_k=12)  # 2 kept groups of 4 experts hold only 8
    prompt = [5, 17, 301, 42]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    ref = copy.deepcopy(ref)  # the session's model stays as built
    for layer in ref.model.layers[1:]:
        layer.mlp.gate.top_k, layer.mlp.gate.topk_group = 12, 3
    assert out.token_ids == greedy(ref, prompt, 4)


@pytest.mark.parametrize("tiny_checkpoint", ["deepseek_v3", "glm4_moe", "gpt_oss"], indirect=True)
def test_bfloat16_compute_stays_close_to_transformers_bfloat16(tiny_checkpoint):
    """bf16 rounds differently in each implementation, so only closeness is asked (fp32 is held to 1e-4)."""
    path, ref, _ = tiny_checkpoint
    prompt = [5, 17, 301, 42, 9, 77, 123, 250, 3, 64, 11]
    out = make_engine(path, dtype="bfloat16").generate(
        [prompt], SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=True, ignore_eos=True)
    )[0]
    want = prompt_logprobs(copy.deepcopy(ref).to(torch.bfloat16), prompt)
    assert max(abs(a - b) for a, b in zip(out.prompt_logprobs[1:], want[1:])) < 0.1
