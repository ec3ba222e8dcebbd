"""DeepSeek-V3.2 and GLM-5 through LLMEngine vs transformers (fp32), prompts longer than index_topk
(the indexer's selection changes the result) and decode steps far past it."""
from __future__ import annotations

import pytest

from tests.moemesh.models.engine_vs_transformers import check_engine_matches

DSA = ["deepseek_v32", "deepseek_v32_plain", "glm_moe_dsa", "glm_moe_dsa_pattern"]


@pytest.mark.parametrize("family_checkpoint", DSA, indirect=True)
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_matches_transformers(family_checkpoint, micro_batches):
    check_engine_matches(family_checkpoint, micro_batches=micro_batches)


@pytest.mark.parametrize("family_checkpoint", ["glm_moe_dsa"], indirect=True)
def test_weight_bytes_count_the_indexers(family_checkpoint):
    from safetensors import safe_open

    from tests.moemesh.models.arch.engine_helpers import make_engine

    path, _, _ = family_checkpoint
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        want = sum(f.get_tensor(k).nbytes for k in f.keys() if "mlp.experts" not in k and "embed_tokens" not in k)
        assert any(".indexer." in k for k in f.keys())
    assert make_engine(path).model.weight_bytes() == want
