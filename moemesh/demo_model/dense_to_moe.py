"""Turn a dense Llama checkpoint (Hugging Face names) into an equivalent Mixtral one.

Each layer's `mlp.{gate,up,down}_proj` becomes `block_sparse_moe.experts.J.{w1,w3,w2}` via
`split_dense_mlp`, plus a zero router `block_sparse_moe.gate.weight [E, H]`; with
`num_experts_per_tok = E` every expert gets weight 1/E and the MoE equals the dense MLP.
Shapes: H hidden, I dense intermediate, E experts.
"""
from __future__ import annotations

import re
from typing import Any

import torch

from moemesh.demo_model.split import split_dense_mlp

_MLP = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight$")

# Llama config keys that carry over to Mixtral unchanged.
_SHARED_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_theta", "attention_dropout",
    "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache",
    "dtype", "torch_dtype",
)


def mixtral_config_from_llama(llama: dict[str, Any], num_experts: int) -> dict[str, Any]:
    """A Mixtral config.json dict equivalent to the Llama config.json dict `llama` (E = num_experts, top-k = E)."""
    inter = llama.get("intermediate_size")
    if not isinstance(inter, int) or inter % num_experts:
        raise ValueError(f"intermediate_size ({inter}) must be an int divisible by num_experts ({num_experts})")
    if llama.get("attention_bias") or llama.get("mlp_bias"):
        raise ValueError("attention_bias/mlp_bias must be false: Mixtral has no biases")
    out = {k: llama[k] for k in _SHARED_KEYS if k in llama}
    out.update(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        intermediate_size=inter // num_experts,
        num_local_experts=num_experts,
        num_experts_per_tok=num_experts,
        router_jitter_noise=0.0,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
        sliding_window=None,
    )
    out.setdefault("hidden_act", "silu")
    return out


def mixtral_state_dict_from_llama(state: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Llama tensors (Hugging Face names) -> Mixtral tensors (names as transformers 5 writes them)."""
    out: dict[str, torch.Tensor] = {}
    mlps: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in state.items():
        m = _MLP.match(name)
        if m:
            mlps.setdefault(int(m.group(1)), {})[m.group(2)] = t
        else:
            out[name] = t
    for layer, parts in sorted(mlps.items()):
        if set(parts) != {"gate", "up", "down"}:
            raise ValueError(f"layer {layer}: mlp needs gate_proj, up_proj and down_proj, got {sorted(parts)}")
        w1s, w3s, w2s = split_dense_mlp(parts["gate"], parts["up"], parts["down"], num_experts)
        moe = f"model.layers.{layer}.block_sparse_moe."
        hidden = parts["gate"].shape[1]
        out[moe + "gate.weight"] = torch.zeros(num_experts, hidden, dtype=parts["gate"].dtype)  # [E, H]
        for j in range(num_experts):
            out[f"{moe}experts.{j}.w1.weight"] = w1s[j].clone()  # [I/E, H]
            out[f"{moe}experts.{j}.w3.weight"] = w3s[j].clone()  # [I/E, H]
            out[f"{moe}experts.{j}.w2.weight"] = w2s[j].clone()  # [H, I/E]
    return out
