"""Tiny random DeepSeek-V3 / GLM-4.5 MoE / gpt-oss checkpoints built by transformers, and the
transformers reference outputs (prompt logprobs, greedy continuations) the models are held to."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.fixtures.checkpoints import build_model

COMMON = dict(vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=256,
              rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)

YARN_DEEPSEEK = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                 "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}


def tiny_config(arch: str, **overrides):
    import transformers as tf

    kw = dict(COMMON)
    if arch == "deepseek_v3":
        kw.update(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4,
                  n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=24,
                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, num_key_value_heads=4,
                  routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True, rope_parameters=dict(YARN_DEEPSEEK))
        kw.update(overrides)
        return tf.DeepseekV3Config(**kw)
    if arch == "glm4_moe":
        kw.update(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4,
                  n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, num_key_value_heads=2,
                  head_dim=16, use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5,
                  routed_scaling_factor=1.5, norm_topk_prob=True)
        kw.update(overrides)
        return tf.Glm4MoeConfig(**kw)
    if arch == "gpt_oss":
        kw.update(intermediate_size=32, num_local_experts=16, num_experts_per_tok=4, head_dim=16, num_key_value_heads=2,
                  sliding_window=4, rms_norm_eps=1e-5)
        kw.update(overrides)
        return tf.GptOssConfig(**kw)
    raise ValueError(f"unknown tiny arch {arch!r}")


def make_checkpoint(arch: str, out_dir: Path, seed: int = 0, **overrides):
    """Build (random weights, std 0.1, random gate correction bias) and save; returns (path, model)."""
    model = build_model(tiny_config(arch, **overrides), seed=seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn_like(buf))
    model.save_pretrained(out_dir)
    return Path(out_dir), model


def prompt_logprobs(model, ids: list[int]) -> list[float | None]:
    """log p(ids[i] | ids[:i]) for i >= 1 (None for the first), float64 from float32 logits."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()  # [n, V]
    lp = torch.log_softmax(logits, dim=-1)
    return [None] + [float(lp[i - 1, t]) for i, t in enumerate(ids) if i > 0]


def greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


def assert_logprobs_close(got, ref, tol: float = 1e-4) -> None:
    assert got[0] is None and ref[0] is None
    assert len(got) == len(ref)
    worst = max(abs(a - b) for a, b in zip(got[1:], ref[1:]))
    assert worst < tol, f"max |logprob diff| {worst:.3g} >= {tol}"
