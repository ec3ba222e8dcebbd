"""DeepSeek-V3, GLM-4.5 MoE, gpt-oss and a DeepSeek BlockwiseFP8 checkpoint through the whole mesh
(control, 2 expert servers, attention, router as processes on loopback, `moemesh generate` as the
client) vs transformers (on the dequantized weights for FP8): prompt logprobs within 1e-4, greedy
continuation identical (up to the tokenizer's EOS, which the mesh stops at)."""
from __future__ import annotations

import shutil

import pytest
import torch
import transformers as tf

from moemesh.launcher.mesh import Mesh, MeshSpec
from tests.fixtures.services import generate_json
from tests.fixtures.tokenizers import make_tiny_tokenizer
from tests.moemesh.models.arch.conftest import GREEDY_TOKENS, PROMPTS
from tests.moemesh.models.arch.reference import assert_logprobs_close, greedy, prompt_logprobs

pytestmark = pytest.mark.slow

EOS = 2  # the tiny tokenizer's <|im_end|>


def checkpoint_and_expected(name: str, build_tiny, build_native):
    """(model dir, (prompt logprobs, greedy tokens) for PROMPTS[0])."""
    if name != "fp8":
        path, _, expected = build_tiny(name)
        return path, expected[PROMPTS[0]]
    _, qdir, deq_dir, _, _ = build_native(name)
    ref = tf.AutoModelForCausalLM.from_pretrained(deq_dir, dtype=torch.float32).eval()
    prompt = list(PROMPTS[0])
    return qdir, (prompt_logprobs(ref, prompt), greedy(ref, prompt, GREEDY_TOKENS))


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe", "gpt_oss", "fp8"])
def served(request, build_tiny, build_native, tmp_path_factory):
    path, expected = checkpoint_and_expected(request.param, build_tiny, build_native)
    model_dir = tmp_path_factory.mktemp(f"mesh-{request.param}")
    shutil.copytree(path, model_dir, dirs_exist_ok=True)
    make_tiny_tokenizer(model_dir)
    mesh = Mesh(MeshSpec(model_dir=str(model_dir), expert_servers=2, start_timeout_s=240, grace_s=5),
                tmp_path_factory.mktemp("mesh-logs"))
    mesh.start()
    yield mesh, expected
    mesh.stop()


def test_mesh_matches_transformers(served):
    mesh, (ref_plp, ref_tokens) = served
    prompt = PROMPTS[0]
    out = generate_json(mesh.router_addr, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", str(GREEDY_TOKENS))
    assert_logprobs_close(out["prompt_logprobs"], ref_plp)
    want = ref_tokens[: ref_tokens.index(EOS) + 1] if EOS in ref_tokens else ref_tokens
    assert out["token_ids"] == want
