import json

import pytest

from moemesh.config import ConfigError, ModelConfig


def test_mixtral_fields(tiny_ckpt):
    cfg = ModelConfig.from_model_dir(tiny_ckpt("mixtral", tie_word_embeddings=True, sliding_window=5)[0])
    assert cfg.architecture == "MixtralForCausalLM"
    assert (cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size) == (8, 2, 128)
    assert cfg.norm_topk_prob and cfg.tie_word_embeddings and cfg.sliding_window == 5
    assert cfg.head_dim == 16 and cfg.num_kv_heads == 2 and cfg.rope_theta == 10000.0
    assert cfg.eos_token_ids == (2,) and cfg.moe_layers == (0, 1)


def test_qwen3_dense_layers_and_window(tiny_ckpt):
    path, _ = tiny_ckpt("qwen3_moe", norm_topk_prob=False, decoder_sparse_step=2, tie_word_embeddings=True, use_sliding_window=True, sliding_window=6)
    cfg = ModelConfig.from_model_dir(path)
    assert not cfg.norm_topk_prob and cfg.qk_norm and cfg.sliding_window == 6
    assert cfg.moe_layers == (1,) and not cfg.is_moe_layer(0)
    path2, _ = tiny_ckpt("qwen3_moe", mlp_only_layers=[0])
    cfg2 = ModelConfig.from_model_dir(path2)
    assert cfg2.moe_layers == (1,) and cfg2.mlp_only_layers == (0,) and cfg2.sliding_window is None


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    with pytest.raises(ConfigError, match="unsupported architecture 'FooForCausalLM'.*MixtralForCausalLM.*Qwen3MoeForCausalLM"):
        ModelConfig.from_model_dir(tmp_path)


def test_missing_and_broken_config(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        ModelConfig.from_model_dir(tmp_path / "absent")
    with pytest.raises(ConfigError, match="config.json not found"):
        ModelConfig.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not readable JSON"):
        ModelConfig.from_model_dir(tmp_path)


def test_generation_config_eos_wins(tiny_ckpt, tmp_path):
    src, _ = tiny_ckpt("mixtral")
    raw = json.loads((src / "config.json").read_text())
    cfg = ModelConfig.from_dicts(raw, {"eos_token_id": [7, 9]})
    assert cfg.eos_token_ids == (7, 9)


def test_scaled_rope_is_refused_by_the_model(tiny_ckpt):
    from moemesh.checkpoint import CheckpointReader
    from moemesh.models.mixtral import MixtralForCausalLM

    path, _ = tiny_ckpt("mixtral")
    raw = json.loads((path / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    cfg = ModelConfig.from_dicts(raw)
    assert cfg.rope_scaling["rope_type"] == "yarn"
    with pytest.raises(ValueError, match="rope_scaling.*yarn"):
        MixtralForCausalLM(cfg, CheckpointReader(path), __import__("torch").float32)


def test_missing_required_field_is_named(tiny_ckpt):
    path, _ = tiny_ckpt("mixtral")
    raw = json.loads((path / "config.json").read_text())
    del raw["hidden_size"]
    with pytest.raises(ConfigError, match="lacks the field 'hidden_size'"):
        ModelConfig.from_dicts(raw)
