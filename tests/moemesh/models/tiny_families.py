"""Tiny random checkpoints of the newer families (DeepSeek-V3.2 / GLM-5 DSA, MiniMax-M2, Kimi-K2.5,
Qwen3-Next / Qwen3.5-MoE), built and saved by transformers, with the transformers outputs they are held
to: prompt logprobs and greedy continuations of PROMPTS."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.fixtures.checkpoints import FAMILY_COMMON as COMMON
from tests.fixtures.checkpoints import YARN_DEEPSEEK, build_model
from tests.moemesh.models.arch.reference import greedy, prompt_logprobs

# the third prompt (70 tokens) is longer than every DSA variant's index_topk (so the indexer selects) and
# than the delta rule's chunk of 64 (so a prefill scans two chunks)
PROMPTS = (
    (5, 17, 301, 42, 9, 77, 123, 250, 3, 64, 11),
    (400, 2, 2, 2, 99),
    tuple((7 * i * i + 3 * i + 11) % 509 for i in range(70)),
)
GREEDY_TOKENS = 32

DSA_COMMON = dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4,
                  n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=24,
                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, num_key_value_heads=4,
                  routed_scaling_factor=2.5, norm_topk_prob=True, index_head_dim=16, index_n_heads=16)

# name -> (transformers config class name, config overrides); the second variant of a family flips its options
VARIANTS = {
    "deepseek_v32": ("DeepseekV32Config", dict(DSA_COMMON, index_topk=8, rope_parameters=dict(YARN_DEEPSEEK))),
    # default rope, a dense layer between MoE layers, no top-k renormalisation, two shared experts, top-4 keys
    "deepseek_v32_plain": ("DeepseekV32Config", dict(DSA_COMMON, index_topk=4, mlp_layer_types=["sparse", "dense", "sparse"],
                                                     norm_topk_prob=False, n_shared_experts=2, n_group=1, topk_group=1,
                                                     rope_parameters={"rope_type": "default", "rope_theta": 50000.0})),
    # GLM-5: every other layer reuses the previous layer's selection
    "glm_moe_dsa": ("GlmMoeDsaConfig", dict(DSA_COMMON, num_hidden_layers=4, index_topk=6, index_topk_freq=2,
                                            index_skip_topk_offset=1, n_group=1, topk_group=1, rms_norm_eps=1e-5)),
    "glm_moe_dsa_pattern": ("GlmMoeDsaConfig", dict(DSA_COMMON, index_topk=10, index_topk_pattern="FSS",
                                                    rope_parameters=dict(YARN_DEEPSEEK))),
    # MiniMax-M2: half of each head rotates; the second variant rotates all of it, MHA, tied embeddings, top-2
    "minimax_m2": ("MiniMaxM2Config", dict(intermediate_size=32, num_local_experts=16, num_experts_per_tok=4, head_dim=16,
                                           num_key_value_heads=2, rotary_dim=8)),
    "minimax_m2_full_rope": ("MiniMaxM2Config", dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                                     head_dim=16, num_key_value_heads=4, rotary_dim=16,
                                                     tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                                                "rope_theta": 10000.0})),
    # Qwen3-Next: three Gated DeltaNet layers then gated attention, a dense layer, 2 value heads per key head
    "qwen3_next": ("Qwen3NextConfig", dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                           linear_value_head_dim=8, num_experts=16, num_experts_per_tok=4,
                                           moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                           mlp_only_layers=[1])),
    # attention in the middle, MoE every other layer, no renormalisation, half-rotary, one value head per
    # key head, conv kernel 3, tied embeddings
    "qwen3_next_plain": ("Qwen3NextConfig", dict(layer_types=["linear_attention", "full_attention", "linear_attention"],
                                                 num_key_value_heads=1, head_dim=16, intermediate_size=96,
                                                 linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=8,
                                                 linear_value_head_dim=12, linear_conv_kernel_dim=3, num_experts=8,
                                                 num_experts_per_tok=2, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=32, norm_topk_prob=False,
                                                 decoder_sparse_step=2, tie_word_embeddings=True,
                                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                  "partial_rotary_factor": 0.5})),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
                                                 num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                                                 linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                                 num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=32)),
}


# Vision-language checkpoints whose text model is served: name -> (config class, model class, text model
# (a VARIANTS name, or the arch tests' "deepseek_v3"), vision config, overrides). Kimi-K2.5 as transformers
# saves it (tied LM head) and as the published checkpoints are laid out (language_model.model.layers.*, an
# untied language_model.lm_head, their architecture name); a Qwen3.5-MoE VL checkpoint.
KIMI_VISION = dict(num_hidden_layers=1, hidden_size=16, intermediate_size=16, num_attention_heads=2)
QWEN_VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64)
MULTIMODAL = {
    "kimi_k25": ("Kimi_K25Config", "Kimi_K25ForConditionalGeneration", "deepseek_v3", KIMI_VISION,
                 dict(projection_hidden_size=16)),
    "kimi_k25_published": ("Kimi_K25Config", "Kimi_K25ForConditionalGeneration", "deepseek_v3", KIMI_VISION,
                           dict(projection_hidden_size=16, tie_word_embeddings=False)),
    "qwen3_5_moe_vl": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", QWEN_VISION, {}),
}


def tiny_config(name: str):
    import transformers as tf

    if name in MULTIMODAL:
        from tests.fixtures.checkpoints import tiny_config as tiny_arch_config

        cls_name, _, text_name, vision, overrides = MULTIMODAL[name]
        text = (tiny_arch_config(text_name) if text_name == "deepseek_v3" else tiny_config(text_name)).to_dict()
        return getattr(tf, cls_name)(text_config=text, vision_config=dict(vision), **overrides)
    cls_name, overrides = VARIANTS[name]
    kw = dict(COMMON)
    kw.update(overrides)
    return getattr(tf, cls_name)(**kw)


def build(name: str, seed: int = 0):
    """A transformers model with random weights (std 0.1, norms near 1, random gate correction biases)."""
    import transformers as tf

    config = tiny_config(name)
    if name in MULTIMODAL:
        torch.manual_seed(seed)
        model = getattr(tf, MULTIMODAL[name][1])(config)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "norm" in pname else p.normal_(0.0, 0.1)
        model.eval()
    else:
        model = build_model(config, seed=seed)
    with torch.no_grad():
        for buf_name, buf in model.named_buffers():
            if buf_name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn_like(buf))
    return model


def make_checkpoint(name: str, out_dir: Path, seed: int = 0):
    """Build and save; returns (path, model)."""
    model = build(name, seed)
    model.save_pretrained(out_dir)
    if name == "kimi_k25_published":
        as_published(Path(out_dir))
    return Path(out_dir), model


def as_published(path: Path) -> None:
    """Rewrite a transformers save of Kimi-K2.5 into the published layout: `language_model.model.layers.*`
    (transformers writes `blocks`), the published architecture name and placeholder field."""
    import json

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    renamed = {k.replace("language_model.model.blocks.", "language_model.model.layers."): v for k, v in tensors.items()}
    assert "language_model.lm_head.weight" in renamed
    save_file(renamed, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["KimiK25ForConditionalGeneration"], media_placeholder_token_id=config["image_token_id"])
    (path / "config.json").write_text(json.dumps(config, indent=2))


def expected_outputs(model) -> dict:
    """{prompt: (prompt logprobs, greedy continuation)} for PROMPTS."""
    return {p: (prompt_logprobs(model, list(p)), greedy(model, list(p), GREEDY_TOKENS)) for p in PROMPTS}
