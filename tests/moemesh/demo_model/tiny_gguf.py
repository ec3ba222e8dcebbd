"""Write a tiny llama GGUF the way llama.cpp's converter does, from a transformers `LlamaForCausalLM`.

q/k rows are permuted with llama.cpp's formula (written out here from its converter, independently
of the code under test), the tokenizer comes from a `tokenizer.json` (gpt2-style metadata), and
`token_embd` can be stored quantized.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}

CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `LlamaModel.permute` (with n_head already set to the kv heads for k)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_llama_gguf(model, tokenizer_dir: Path, path: Path, embd_qtype: str = "F32") -> Path:
    """Write `model` (a transformers LlamaForCausalLM) and the tokenizer in `tokenizer_dir` as a GGUF file."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_vocab_size(cfg.vocab_size)

    tok = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    embd = sd["model.embed_tokens.weight"]
    if embd_qtype == "F32":
        writer.add_tensor("token_embd.weight", embd)
    else:
        qtype = gguf.GGMLQuantizationType[embd_qtype]
        writer.add_tensor("token_embd.weight", gguf.quants.quantize(embd, qtype), raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        writer.add_tensor("output.weight", sd["lm_head.weight"])
    for layer in range(cfg.num_hidden_layers):
        for hf, name in HF_TO_GGUF.items():
            w = sd[f"model.layers.{layer}.{hf}"]
            if name == "attn_q.weight":
                w = llamacpp_permute(w, cfg.num_attention_heads)
            elif name == "attn_k.weight":
                w = llamacpp_permute(w, cfg.num_key_value_heads)
            writer.add_tensor(f"blk.{layer}.{name}", np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
