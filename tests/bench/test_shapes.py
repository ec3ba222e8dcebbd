"""bench/shapes.py: named shapes, the safetensors writer, its cache stamp, and the checkpoints it
writes as the engine and transformers read them."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from bench.shapes import (
    DEMO, QWEN3_SPARSE, QWEN3_SPARSE_SKEW, SHAPES, STAMP, Shape, checkpoint_bytes, ensure_checkpoint, is_current, write_tokenizer,
)
from moemesh.models.registry import parse_model_config
from moemesh.engine import EngineConfig, LLMEngine, SamplingParams
from tests.bench.conftest import TINY_SHAPES
from tests.fixtures.reference import hf_greedy, hf_prompt_logprobs

PROMPT = [5, 17, 301, 42, 9, 77, 123, 250, 3, 64, 11, 400]
NEW_TOKENS = 16


def test_qwen3_sparse_has_the_issue_proportions():
    cfg = parse_model_config(QWEN3_SPARSE.config_json(1, 2))
    assert cfg.architecture == "Qwen3MoeForCausalLM"
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_experts, cfg.moe_intermediate_size, cfg.top_k) == (1024, 16, 64, 384, 8)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (16, 4, 64, 49152)
    assert cfg.moe_layers == tuple(range(16)) and cfg.torch_dtype == "bfloat16" and cfg.qk_norm
    experts = 16 * 64 * 3 * 1024 * 384 * 2
    assert experts == pytest.approx(2.42e9, rel=0.01)
    assert QWEN3_SPARSE.checkpoint_bytes() == pytest.approx(2.70e9, rel=0.01)


@pytest.mark.slow  # reads the demo model: > 2 s
def test_demo_shape_is_the_demo_model_shape():
    """DEMO against the config the demo model's converter derives from the GGUF it is built from."""
    from moemesh.demo_model.build import DEMO_NUM_EXPERTS
    from moemesh.demo_model.convert import llama_config
    from moemesh.demo_model.dense_to_moe import mixtral_config_from_llama
    from moemesh.demo_model.gguf_source import GgufLlama
    from moemesh.demo_model.gguf_tokenizer import GgufTokenizerSpec
    from moemesh.demo_model.locate import find_demo_gguf

    src = GgufLlama(find_demo_gguf())
    demo = parse_model_config(mixtral_config_from_llama(llama_config(src.hparams, GgufTokenizerSpec.from_fields(src.field), "float32"),
                                                            DEMO_NUM_EXPERTS))
    ours = parse_model_config(DEMO.config_json(1, 2))
    for name in ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "num_experts",
                 "top_k", "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "torch_dtype"):
        assert getattr(ours, name) == getattr(demo, name), name
    assert ours.raw["intermediate_size"] == demo.raw["intermediate_size"]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_named_shape_is_read_by_the_engine_config(name):
    shape = SHAPES[name]
    cfg = parse_model_config(shape.config_json(1, 2))
    assert (cfg.num_experts, cfg.top_k, cfg.num_layers, cfg.hidden_size) == (shape.num_experts, shape.top_k, shape.num_layers, shape.hidden_size)


@pytest.mark.parametrize("bad, field", [
    (dict(top_k=65), "top_k"), (dict(num_kv_heads=3), "num_kv_heads"), (dict(hidden_size=0), "hidden_size"),
    (dict(dtype="float16"), "dtype"), (dict(architecture="LlamaForCausalLM"), "architecture"), (dict(weight_std=0.0), "weight_std"),
])
def test_bad_proportions_are_a_value_error_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        replace(QWEN3_SPARSE, **bad)


@pytest.mark.parametrize("name", sorted(TINY_SHAPES))
def test_tiny_checkpoint_matches_transformers(tiny_shape_dir, name):
    """float32 on the bf16 weights: the engine's prompt logprobs and greedy tokens against transformers'
    own model class read from the same directory."""
    import transformers as tf

    path = tiny_shape_dir(name)
    shape = TINY_SHAPES[name]
    ref = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(ref).__name__ == shape.architecture
    assert ref.config.num_experts_per_tok == shape.top_k
    engine = LLMEngine(EngineConfig(str(path), dtype="float32", block_size=4, kv_cache_tokens=256))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, prompt_logprobs=True)
    result = engine.generate([PROMPT], params)[0]
    ours = torch.tensor(result.prompt_logprobs[1:])
    torch.testing.assert_close(ours, torch.tensor(hf_prompt_logprobs(ref, PROMPT)), atol=1e-4, rtol=0)
    assert result.token_ids == hf_greedy(ref, PROMPT, NEW_TOKENS)[0]


def test_weights_are_scaled_like_a_trained_model(tiny_shape_dir):
    from safetensors import safe_open

    path = tiny_shape_dir("qwen3-sparse-tiny")
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shape = TINY_SHAPES["qwen3-sparse-tiny"]
    assert len(index) == sum(len(ts) for _, ts in shape.shards())
    with safe_open(str(path / index["model.layers.1.mlp.experts.3.down_proj.weight"]), "pt") as f:
        down = f.get_tensor("model.layers.1.mlp.experts.3.down_proj.weight")
        norm = f.get_tensor("model.layers.1.self_attn.q_norm.weight")
    assert down.dtype == torch.bfloat16 and down.shape == (shape.hidden_size, shape.expert_intermediate)
    assert down.float().std().item() == pytest.approx(shape.weight_std, rel=0.1)
    assert torch.equal(norm, torch.ones_like(norm))
    assert torch.equal(shape.tensor("model.layers.1.mlp.experts.3.down_proj.weight", tuple(down.shape)), down)  # reproducible
    reseeded = replace(shape, seed=1).tensor("model.layers.1.mlp.experts.3.down_proj.weight", tuple(down.shape))
    assert not torch.equal(reseeded, down)


def test_checkpoint_bytes_on_disk_are_the_tensor_bytes(tiny_shape_dir):
    path = tiny_shape_dir("qwen3-sparse-tiny")
    expected = TINY_SHAPES["qwen3-sparse-tiny"].checkpoint_bytes()
    assert expected <= checkpoint_bytes(path) <= expected + 64 * 1024  # safetensors headers


def test_tokenizer_files_match_the_vocabulary(tiny_shape_dir):
    from tokenizers import Tokenizer

    path = tiny_shape_dir("qwen3-sparse-tiny")
    config = json.loads((path / "config.json").read_text())
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.get_vocab_size() == config["vocab_size"] == 49152
    gen = json.loads((path / "generation_config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (gen["bos_token_id"], gen["eos_token_id"])
    assert tok.decode(tok.encode("Hello world").ids) == "Hello world"


@pytest.mark.slow  # reads the demo GGUF: > 2 s
def test_tokenizer_rebuilt_from_the_gguf_when_the_demo_model_is_not_built(tmp_path, monkeypatch, tiny_shape_dir):
    monkeypatch.setenv("MOEMESH_HOME", str(tmp_path / "empty-home"))
    out = tmp_path / "tok"
    out.mkdir()
    gen = write_tokenizer(out)
    assert gen["eos_token_id"] is not None
    built = tiny_shape_dir("qwen3-sparse-tiny")
    from tokenizers import Tokenizer

    a, b = (Tokenizer.from_file(str(p / "tokenizer.json")) for p in (out, built))
    text = "Name three rivers: 1. the Nile, 2. the Amazon"
    assert a.encode(text).ids == b.encode(text).ids


def test_cache_is_kept_while_the_spec_matches_and_rebuilt_when_it_changes(tmp_path):
    shape = replace(TINY_SHAPES["qwen3-sparse-tiny"], num_layers=1, num_experts=4, top_k=2)
    out = tmp_path / "cached"
    ensure_checkpoint(shape, out)
    assert is_current(out, shape)
    first = (out / "model-00002-of-00002.safetensors").stat().st_mtime_ns
    ensure_checkpoint(shape, out)
    assert (out / "model-00002-of-00002.safetensors").stat().st_mtime_ns == first  # kept
    changed = replace(shape, num_experts=8)
    assert not is_current(out, changed)
    ensure_checkpoint(changed, out)
    assert is_current(out, changed) and json.loads((out / "config.json").read_text())["num_experts"] == 8
    assert json.loads((out / STAMP).read_text())["shape"]["num_experts"] == 8
    assert not list(tmp_path.glob(".cached.*"))  # no temp directory left behind


def test_a_directory_that_is_not_a_bench_checkpoint_is_never_replaced(tmp_path):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="refusing to replace"):
        ensure_checkpoint(replace(TINY_SHAPES["qwen3-sparse-tiny"], num_layers=1), out)
    assert (out / "notes.txt").read_text() == "keep me"


def test_shape_json_round_trips_every_field():
    for shape in (QWEN3_SPARSE, QWEN3_SPARSE_SKEW):
        stamp = json.loads(json.dumps(shape.stamp()))
        assert Shape(**stamp["shape"]) == shape
    assert "router_skew" not in QWEN3_SPARSE.stamp()["shape"]  # checkpoints written before the skew stay current


def test_the_skewed_variant_favours_its_hot_experts_zipf_like(tiny_shape_dir):
    from safetensors import safe_open

    shape = TINY_SHAPES["qwen3-sparse-tiny-skew"]
    assert shape.preference_ranks()[:5] == [0, 4, 5, 6, 1] and shape.router_hot == (0, 4, 8, 12)
    assert QWEN3_SPARSE_SKEW.router_hot == tuple(range(0, 32, 4)) and QWEN3_SPARSE_SKEW.num_experts == 64
    path = tiny_shape_dir("qwen3-sparse-tiny-skew")
    name = "model.layers.1.mlp.gate.weight"
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(path / index[name]), "pt") as f:
        router = f.get_tensor(name).float()  # [E, H]
    plain = replace(shape, router_skew=0.0, router_hot=()).tensor(name, tuple(router.shape)).float()
    ranks = torch.tensor(shape.preference_ranks(), dtype=torch.float32)
    torch.testing.assert_close(router, plain * ((16**0.5 / (ranks + 1)) ** 1.0)[:, None], rtol=1e-2, atol=1e-3)  # bf16 rounding
    # the top-4 picks of varied hidden states favour the hot experts (a quarter of the experts: 41%), in rank order
    x = torch.randn(20_000, shape.hidden_size, generator=torch.Generator().manual_seed(0))
    picks = torch.bincount((x @ router.T).topk(shape.top_k, dim=1).indices.flatten(), minlength=16).float()
    share = picks / picks.sum()
    assert share[[0, 4, 8, 12]].sum() > 0.35 and share[0] > share[4] > share[8] > share[12] > share[[1, 2, 3]].max()
    with pytest.raises(ValueError, match="router_hot"):
        replace(shape, router_hot=(0, 0))
    with pytest.raises(ValueError, match="router_skew"):
        replace(shape, router_skew=-1.0)
