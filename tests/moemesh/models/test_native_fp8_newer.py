"""Native BlockwiseFP8 checkpoints of the newer families (DeepSeek-V3.2 and GLM-5 with their indexers,
MiniMax-M2 with Mixtral's expert layout, Qwen3-Next with its Gated DeltaNet and shared-expert
projections), written by compressed-tensors' quantizer with 32x32 blocks: routed experts are served as
stored (FP8 bytes unchanged), every other linear weight is dequantized at load, and the outputs match
transformers run on the oracle's dequantized weights."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from kernels.formats import FP8BlockExperts
from moemesh.checkpoint import CheckpointReader
from tests.moemesh.models.arch.native_quant import write_fp8_block
from tests.moemesh.models.arch.reference import assert_logprobs_close, greedy, prompt_logprobs
from tests.moemesh.models.engine_vs_transformers import make_engine, run_prompts
from tests.moemesh.models.tiny_families import PROMPTS, make_checkpoint

# family -> the name of one stored expert's up projection ({layer}, {expert})
UP_PROJ = {
    "deepseek_v32": "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
    "glm_moe_dsa": "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
    "minimax_m2": "model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight",
    "qwen3_next": "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
}


@pytest.mark.parametrize("family", sorted(UP_PROJ))
def test_fp8_checkpoint_served_as_stored_matches_dequantized_reference(family, tmp_path):
    src, _ = make_checkpoint(family, tmp_path / "src")
    qdir, deq_dir = write_fp8_block(src, tmp_path / "fp8", (32, 32))
    engine = make_engine(qdir)
    layer = engine.model_config.moe_layers[-1]
    w = engine.experts.layers[layer].weights
    assert isinstance(w.gate_up, FP8BlockExperts) and isinstance(w.down, FP8BlockExperts)
    inter = engine.model_config.moe_intermediate_size
    stored = CheckpointReader(qdir).get(UP_PROJ[family].format(layer=layer, expert=3))
    assert torch.equal(w.gate_up.weight[3, inter:].view(torch.uint8), stored.view(torch.uint8))

    ref = tf.AutoModelForCausalLM.from_pretrained(deq_dir, dtype=torch.float32).eval()
    prompt = list(PROMPTS[2])
    res = run_prompts(engine, [prompt], 8)[0]
    assert_logprobs_close(res.prompt_logprobs, prompt_logprobs(ref, prompt))
    assert res.token_ids == greedy(ref, prompt, 8)
