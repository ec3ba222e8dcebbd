"""Native quantized checkpoints (DeepSeek BlockwiseFP8 with partial edge blocks, ModelOpt NVFP4 experts,
gpt-oss MXFP4 experts) written by independent quantizers, loaded as stored by the engine's default path
(non-expert FP8 weights by the DeepSeek model, experts by moemesh.moe.expert_loader):
  * experts stay in their stored format, bytes unchanged;
  * outputs match transformers run on the oracle's dequantized weights (1e-4, identical greedy);
  * outputs stay close to the unquantized model (figures printed with -s)."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from kernels.formats import FP8BlockExperts, MXFP4Experts, NVFP4Experts
from moemesh.checkpoint import CheckpointReader
from moemesh.engine.sampling_params import SamplingParams
from moemesh.models.registry import load_model_config
from tests.moemesh.models.arch.conftest import NATIVE
from tests.moemesh.models.arch.engine_helpers import make_engine
from tests.moemesh.models.arch.reference import assert_logprobs_close, greedy, prompt_logprobs

pytestmark = pytest.mark.parametrize("native_checkpoint", list(NATIVE), indirect=True, scope="module")

PROMPT = [5, 17, 301, 42, 9, 77, 123, 250, 3, 64, 11, 200, 100, 50, 25, 12, 6, 3, 1, 0]
# format -> the expert type the engine must hold
KIND = {"fp8": FP8BlockExperts, "nvfp4": NVFP4Experts, "mxfp4": MXFP4Experts}


@pytest.fixture(scope="module")
def quantized(native_checkpoint):
    fmt, qdir, deq_dir, model, src = native_checkpoint
    cfg, reader = load_model_config(qdir), CheckpointReader(qdir)
    engine = make_engine(qdir)
    params = SamplingParams(max_new_tokens=32, temperature=0.0, prompt_logprobs=True, ignore_eos=True)
    result = engine.generate([PROMPT], params)[0]
    return dict(fmt=fmt, kind=KIND[fmt], qdir=qdir, deq_dir=deq_dir, model=model, experts=engine.experts, reader=reader,
                cfg=cfg, result=result)


def test_experts_are_served_as_stored(quantized):
    cfg, reader, experts = quantized["cfg"], quantized["reader"], quantized["experts"]
    layer = cfg.moe_layers[-1]
    w = experts.layers[layer].weights
    assert isinstance(w.gate_up, quantized["kind"]) and isinstance(w.down, quantized["kind"])
    e, inter = 3, cfg.moe_intermediate_size
    p = f"model.layers.{layer}.mlp.experts"
    if quantized["fmt"] == "fp8":
        assert torch.equal(w.gate_up.weight[e, inter:].view(torch.uint8), reader.get(f"{p}.{e}.up_proj.weight").view(torch.uint8))
        assert torch.equal(w.down.scale[e], reader.get(f"{p}.{e}.down_proj.weight_scale_inv"))
    elif quantized["fmt"] == "nvfp4":
        assert torch.equal(w.gate_up.weight[e, inter:], reader.get(f"{p}.{e}.up_proj.weight"))
        assert torch.equal(w.down.weight_scale[e].view(torch.uint8), reader.get(f"{p}.{e}.down_proj.weight_scale").view(torch.uint8))
    else:  # gpt-oss: interleaved rows on disk -> gate rows (even) first, then up rows (odd)
        stored = reader.get(f"{p}.gate_up_proj_blocks")[e]  # [2I, KB, 16]
        assert torch.equal(w.gate_up.blocks[e, :inter], stored[0::2])
        assert torch.equal(w.gate_up.blocks[e, inter:], stored[1::2])
        assert torch.equal(w.down.scales[e], reader.get(f"{p}.down_proj_scales")[e])


def test_matches_transformers_on_dequantized_weights(quantized):
    ref = tf.AutoModelForCausalLM.from_pretrained(quantized["deq_dir"], dtype=torch.float32).eval()
    res = quantized["result"]
    assert_logprobs_close(res.prompt_logprobs, prompt_logprobs(ref, PROMPT))
    assert res.token_ids == greedy(ref, PROMPT, 32)


# mean |logprob difference| per prompt token vs the unquantized fp32 model; tiny random models (std 0.1
# weights) are far more sensitive than trained ones, so these bounds are loose but catch broken scales
MEAN_BOUND = {"fp8": 0.25, "nvfp4": 0.25, "mxfp4": 0.25}


def test_close_to_unquantized_model(quantized):
    ref = prompt_logprobs(quantized["model"], PROMPT)[1:]
    got = quantized["result"].prompt_logprobs[1:]
    diffs = [abs(a - b) for a, b in zip(got, ref)]
    mean = sum(diffs) / len(diffs)
    print(f"\n{quantized['fmt']}: mean |dlogprob| {mean:.4f}, max {max(diffs):.4f} over {len(diffs)} prompt tokens")
    assert 0 < mean < MEAN_BOUND[quantized["fmt"]]

