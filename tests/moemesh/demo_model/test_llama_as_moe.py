"""A dense Llama converted to an 8-expert Mixtral by the demo recipe reproduces the dense logits.

Recipe: each layer's MLP (intermediate I) split by neurons into 8 experts of I/8, zero router,
num_experts_per_tok = 8 (each expert weighted 1/8), each expert's down projection scaled by 8.
"""
from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from moemesh.demo_model.split import split_dense_mlp
from moemesh.engine import EngineConfig, LLMEngine, SamplingParams
from tests.fixtures.checkpoints import build_model, tiny_config
from tests.fixtures.reference import hf_greedy, hf_prompt_logprobs

NUM_EXPERTS = 8
PROMPT = [7, 300, 12, 45, 450, 3, 99, 128, 64]


def llama_to_mixtral(llama, out_dir):
    cfg = llama.config
    tensors = {}
    for name, t in llama.state_dict().items():
        if ".mlp." in name or "rotary" in name or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue
        tensors[name] = t.contiguous()
    for layer in range(cfg.num_hidden_layers):
        mlp = llama.model.layers[layer].mlp
        w1s, w3s, w2s = split_dense_mlp(mlp.gate_proj.weight.data, mlp.up_proj.weight.data, mlp.down_proj.weight.data, NUM_EXPERTS)
        p = f"model.layers.{layer}.block_sparse_moe"
        tensors[f"{p}.gate.weight"] = torch.zeros(NUM_EXPERTS, cfg.hidden_size)
        for e in range(NUM_EXPERTS):
            tensors[f"{p}.experts.{e}.w1.weight"] = w1s[e]
            tensors[f"{p}.experts.{e}.w3.weight"] = w3s[e]
            tensors[f"{p}.experts.{e}.w2.weight"] = w2s[e]
    save_file(tensors, str(out_dir / "model.safetensors"))
    config = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size // NUM_EXPERTS,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "num_local_experts": NUM_EXPERTS,
        "num_experts_per_tok": NUM_EXPERTS,
        "dtype": "float32",
    }
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


def test_converted_llama_reproduces_dense_logits_and_greedy(tmp_path):
    llama = build_model(tiny_config("llama", tie_word_embeddings=True), seed=3)
    path = llama_to_mixtral(llama, tmp_path)
    engine = LLMEngine(EngineConfig(str(path), block_size=4, kv_cache_tokens=128))
    result = engine.generate([PROMPT], SamplingParams(max_new_tokens=32, temperature=0.0, prompt_logprobs=True, ignore_eos=True))[0]
    torch.testing.assert_close(
        torch.tensor(result.prompt_logprobs[1:]), torch.tensor(hf_prompt_logprobs(llama, PROMPT)), atol=1e-4, rtol=0
    )
    assert result.token_ids == hf_greedy(llama, PROMPT, 32)[0]


def test_conversion_without_the_scale_does_not_match(tmp_path):
    """Guards the comparison above: dropping the x8 on w2 must change the logits."""
    llama = build_model(tiny_config("llama", tie_word_embeddings=True), seed=3)
    path = llama_to_mixtral(llama, tmp_path)
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".w2.weight")]:
        tensors[name] = tensors[name] / NUM_EXPERTS
    save_file(tensors, str(path / "model.safetensors"))
    engine = LLMEngine(EngineConfig(str(path), block_size=4, kv_cache_tokens=128))
    result = engine.generate([PROMPT], SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=True))[0]
    ref = torch.tensor(hf_prompt_logprobs(llama, PROMPT))
    assert (torch.tensor(result.prompt_logprobs[1:]) - ref).abs().max() > 1e-2
