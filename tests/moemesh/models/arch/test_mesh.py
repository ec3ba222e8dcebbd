"""DeepSeek-V3, GLM-4.5 MoE and gpt-oss through the whole mesh (control, 2 expert servers, attention,
router as processes on loopback, `moemesh generate` as the client) vs transformers: prompt logprobs
within 1e-4, greedy continuation identical (up to the tokenizer's EOS, which the mesh stops at)."""
from __future__ import annotations

import shutil

import pytest

from moemesh.launcher.mesh import Mesh, MeshSpec
from tests.fixtures.tokenizers import make_tiny_tokenizer
from tests.moemesh.models.arch.conftest import GREEDY_TOKENS, PROMPTS
from tests.moemesh.models.arch.reference import assert_logprobs_close
from tests.e2e.helpers import generate_json

pytestmark = pytest.mark.slow

EOS = 2  # the tiny tokenizer's <|im_end|>


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe", "gpt_oss"])
def served(request, build_tiny, tmp_path_factory):
    path, _, expected = build_tiny(request.param)
    model_dir = tmp_path_factory.mktemp(f"mesh-{request.param}")
    shutil.copytree(path, model_dir, dirs_exist_ok=True)
    make_tiny_tokenizer(model_dir)
    mesh = Mesh(MeshSpec(model_dir=str(model_dir), expert_servers=2, start_timeout_s=240, grace_s=5),
                tmp_path_factory.mktemp("mesh-logs"))
    mesh.start()
    yield mesh, expected
    mesh.stop()


def test_mesh_matches_transformers(served):
    mesh, expected = served
    prompt = PROMPTS[0]
    out = generate_json(mesh.router_addr, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", str(GREEDY_TOKENS))
    ref_plp, ref_tokens = expected[prompt]
    assert_logprobs_close(out["prompt_logprobs"], ref_plp)
    want = ref_tokens[: ref_tokens.index(EOS) + 1] if EOS in ref_tokens else ref_tokens
    assert out["token_ids"] == want
