"""Convert a dense llama GGUF into a Mixtral checkpoint whose experts reproduce the dense MLP.

Writes into `out_dir`: `config.json`, `generation_config.json`, `model.safetensors` (tensor names
as transformers 5 writes Mixtral), `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`.
The GGUF is read as a dense Hugging Face Llama one layer at a time, and `dense_to_moe` splits each
layer's MLP into experts behind a zero gate with top-k = E; attention, norms, embeddings are copied.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from moemesh.demo_model.dense_to_moe import mixtral_config_from_llama, mixtral_state_dict_from_llama
from moemesh.demo_model.gguf_source import GgufLlama, LlamaHyperParams
from moemesh.demo_model.gguf_tokenizer import GgufTokenizerSpec, build_backend, tokenizer_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)

# GGUF tensor name (per layer) -> Hugging Face Llama name suffix.
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def llama_config(hp: LlamaHyperParams, tok: GgufTokenizerSpec, dtype: str) -> dict[str, Any]:
    """The dense model's Hugging Face `LlamaForCausalLM` config.json dict."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": hp.vocab_size,
        "hidden_size": hp.hidden_size,
        "intermediate_size": hp.intermediate_size,
        "num_hidden_layers": hp.num_layers,
        "num_attention_heads": hp.num_heads,
        "num_key_value_heads": hp.num_kv_heads,
        "head_dim": hp.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": hp.max_position_embeddings,
        "rms_norm_eps": hp.rms_norm_eps,
        "rope_parameters": {"rope_theta": hp.rope_theta, "rope_type": "default"},
        "rope_theta": hp.rope_theta,
        "attention_dropout": 0.0,
        "tie_word_embeddings": hp.tied_embeddings,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def generation_config(tok: GgufTokenizerSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    if tok.pad_token_id is not None:
        out["pad_token_id"] = tok.pad_token_id
    return out


def llama_layer_from_gguf(src: GgufLlama, layer: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One decoder layer's dense Llama tensors (Hugging Face names and layout)."""
    prefix = f"model.layers.{layer}."
    return {prefix + hf: src.tensor(f"blk.{layer}.{name}").to(dtype) for name, hf in LAYER_TENSORS.items()}


def convert_weights(
    src: GgufLlama, dtype: torch.dtype, num_experts: int, progress: Callable[[str], None]
) -> dict[str, torch.Tensor]:
    """Hugging Face Mixtral state dict (E = num_experts), converted one layer at a time."""
    hp = src.hparams
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": src.tensor("token_embd.weight").to(dtype)}
    out["model.norm.weight"] = src.tensor("output_norm.weight").to(dtype)
    if not hp.tied_embeddings:
        out["lm_head.weight"] = src.tensor("output.weight").to(dtype)
    for layer in range(hp.num_layers):
        progress(f"converting layer {layer + 1}/{hp.num_layers}")
        out.update(mixtral_state_dict_from_llama(llama_layer_from_gguf(src, layer, dtype), num_experts))
    return out


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf_to_mixtral(
    gguf_path: str | Path,
    out_dir: str | Path,
    dtype: str = "float32",
    num_experts: int = 8,
    progress: Callable[[str], None] = lambda msg: None,
) -> Path:
    """Write the Mixtral checkpoint of `gguf_path` into the directory `out_dir` (created if absent)."""
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    progress(f"reading {gguf_path}")
    src = GgufLlama(gguf_path)
    tok = GgufTokenizerSpec.from_fields(src.field)
    config = mixtral_config_from_llama(llama_config(src.hparams, tok, dtype), num_experts)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", generation_config(tok))
    build_backend(tok).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(tok))
    if tok.chat_template:
        (out_dir / "chat_template.jinja").write_text(tok.chat_template, encoding="utf-8")
    tensors = convert_weights(src, DTYPES[dtype], num_experts, progress)
    progress("writing model.safetensors")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "model.safetensors").chmod(0o644)
    return out_dir
