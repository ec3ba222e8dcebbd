"""Mixtral and Qwen3-MoE through LLMEngine against transformers on tiny random checkpoints."""
from __future__ import annotations

import pytest
import torch

from moemesh.engine import EngineConfig, LLMEngine, SamplingParams
from tests.fixtures.reference import hf_greedy, hf_prompt_logprobs

PROMPT = [5, 17, 301, 42, 9, 77, 123, 250, 3, 64, 11, 400]
NEW_TOKENS = 32

FP32_VARIANTS = {
    "mixtral": ("mixtral", {}),
    "mixtral_tied_window_top3": ("mixtral", dict(tie_word_embeddings=True, sliding_window=5, num_experts_per_tok=3)),
    "qwen3_norm_dense_first": ("qwen3_moe", dict(norm_topk_prob=True, mlp_only_layers=[0])),
    "qwen3_nonorm_sparse_step_tied_window": (
        "qwen3_moe",
        dict(norm_topk_prob=False, decoder_sparse_step=2, tie_word_embeddings=True, use_sliding_window=True, sliding_window=6),
    ),
    "qwen3_gqa4_top1": ("qwen3_moe", dict(num_attention_heads=8, num_key_value_heads=2, num_experts_per_tok=1)),
    "mixtral_tied_all_experts": ("mixtral", dict(tie_word_embeddings=True, num_experts_per_tok=4, num_local_experts=4)),
}


def run_engine(path, dtype: str = "auto", **cfg):
    engine = LLMEngine(EngineConfig(str(path), dtype=dtype, block_size=4, kv_cache_tokens=256, **cfg))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, prompt_logprobs=True)
    return engine.generate([PROMPT], params)[0]


# 1 thread: float32 matrices held plain [out, in] for the compiled CPU kernels (or [in, out] for MKL
# where none is built); 2 threads: packed by oneDNN (the tied LM head as a second, packed copy) and,
# with pack_experts, the concatenated experts too.
LAYOUTS = {"plain": dict(num_threads=1), "packed": dict(num_threads=2, pack_experts=True)}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("variant", sorted(FP32_VARIANTS))
def test_fp32_prompt_logprobs_and_greedy_match_transformers(tiny_ckpt, variant, layout):
    arch, overrides = FP32_VARIANTS[variant]
    path, model = tiny_ckpt(arch, **overrides)
    result = run_engine(path, **LAYOUTS[layout])
    assert result.prompt_logprobs[0] is None
    ours = torch.tensor(result.prompt_logprobs[1:])
    ref = torch.tensor(hf_prompt_logprobs(model, PROMPT))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    tokens, _ = hf_greedy(model, PROMPT, NEW_TOKENS)
    assert result.token_ids == tokens
    assert result.finish_reason == "length"


def test_sliding_window_is_shorter_than_prompt_and_matters(tiny_ckpt):
    """The windowed variant must differ from the same weights without a window (else the test is moot)."""
    path_w, model_w = tiny_ckpt("mixtral", tie_word_embeddings=True, sliding_window=5, num_experts_per_tok=3)
    assert model_w.config.sliding_window < len(PROMPT)
    windowed = run_engine(path_w)
    path_full, _ = tiny_ckpt("mixtral", tie_word_embeddings=True, num_experts_per_tok=3)
    full = run_engine(path_full)
    assert windowed.prompt_logprobs[1:5] == pytest.approx(full.prompt_logprobs[1:5], abs=1e-5)
    assert windowed.prompt_logprobs[-1] != pytest.approx(full.prompt_logprobs[-1], abs=1e-3)


def load_reference(path, dtype):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def teacher_forced_agreement(path, ref) -> float:
    """Feed transformers' greedy continuation; at every step where its choice is clear (top-2 logit
    margin >= 0.1), does the engine pick the same next token? Returns the agreeing fraction."""
    tokens, margins = hf_greedy(ref, PROMPT, NEW_TOKENS)
    clear = [i for i, m in enumerate(margins) if m >= 0.1]
    assert len(clear) >= NEW_TOKENS // 2, "too few clear steps for the comparison to mean anything"
    engine = LLMEngine(EngineConfig(str(path), block_size=4, kv_cache_tokens=1024, max_num_seqs=64))
    prefixes = [PROMPT + tokens[:i] for i in clear]
    nexts = engine.generate(prefixes, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
    return sum(r.token_ids[0] == tokens[i] for r, i in zip(nexts, clear)) / len(clear)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_bf16_dense_routing_matches_transformers(tiny_ckpt, arch):
    """top-k == E: no discrete routing, so bf16 rounding cannot flip an expert choice; every clear
    greedy step must agree."""
    path, _ = tiny_ckpt(arch, dtype=torch.bfloat16, num_experts_per_tok=8)
    ref = load_reference(path, torch.bfloat16)
    result = run_engine(path)  # dtype auto -> bfloat16
    ours = torch.tensor(result.prompt_logprobs[1:])
    torch.testing.assert_close(ours, torch.tensor(hf_prompt_logprobs(ref, PROMPT)), atol=0.05, rtol=0)
    assert teacher_forced_agreement(path, ref) == 1.0


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_bf16_top2_matches_transformers_loosely(tiny_ckpt, arch):
    """With top-2 routing a one-ulp bf16 difference can flip a near-tied expert choice for a token,
    so the continuation comparison allows a few disagreeing steps."""
    path, _ = tiny_ckpt(arch, dtype=torch.bfloat16)
    ref = load_reference(path, torch.bfloat16)
    result = run_engine(path)
    ours = torch.tensor(result.prompt_logprobs[1:])
    torch.testing.assert_close(ours, torch.tensor(hf_prompt_logprobs(ref, PROMPT)), atol=0.05, rtol=0)
    assert teacher_forced_agreement(path, ref) >= 0.8


def test_float32_compute_on_bf16_checkpoint_matches_transformers_float32(tiny_ckpt):
    path, _ = tiny_ckpt("mixtral", dtype=torch.bfloat16)
    ref = load_reference(path, torch.float32)
    result = run_engine(path, dtype="float32")
    torch.testing.assert_close(torch.tensor(result.prompt_logprobs[1:]), torch.tensor(hf_prompt_logprobs(ref, PROMPT)), atol=1e-4, rtol=0)
    assert result.token_ids == hf_greedy(ref, PROMPT, NEW_TOKENS)[0]
