"""Native BlockwiseFP8 checkpoints (`quant_method: fp8`, 32x32 blocks) of the standard decoder's families
(Mixtral, Qwen3-MoE, as Qwen3-30B-A3B-FP8 is published): routed experts are served as stored and the
attention weights are dequantized at load, so the outputs match transformers run on the oracle's
dequantized weights."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from kernels.formats import FP8BlockExperts
from tests.fixtures.checkpoints import make_tiny_checkpoint
from tests.moemesh.models.arch.native_quant import write_fp8_block
from tests.moemesh.models.arch.reference import assert_logprobs_close, greedy, prompt_logprobs
from tests.moemesh.models.engine_vs_transformers import make_engine, run_prompts

PROMPT = [5, 17, 301, 42, 9, 77, 123, 250, 3, 64, 11, 200, 100, 50, 25, 12, 6, 3, 1, 0]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_fp8_checkpoint_matches_dequantized_reference(arch, tmp_path):
    src, _ = make_tiny_checkpoint(arch, tmp_path / "src")
    qdir, deq_dir = write_fp8_block(src, tmp_path / "fp8", (32, 32))
    engine = make_engine(qdir)
    w = engine.experts.layers[engine.model_config.moe_layers[0]].weights
    assert isinstance(w.gate_up, FP8BlockExperts) and isinstance(w.down, FP8BlockExperts)

    ref = tf.AutoModelForCausalLM.from_pretrained(deq_dir, dtype=torch.float32).eval()
    res = run_prompts(engine, [PROMPT], 8)[0]
    assert_logprobs_close(res.prompt_logprobs, prompt_logprobs(ref, PROMPT))
    assert res.token_ids == greedy(ref, PROMPT, 8)
