"""The architecture registry: a plain table of the supported architectures, and reading a model
directory's config through it."""
import json

import pytest

from moemesh.config import ConfigError
from moemesh.models.architecture import ArchitectureSpec
from moemesh.models.registry import ARCHITECTURES, get_architecture, load_model_config, parse_model_config, supported_architectures


def test_the_table_lists_every_architecture_once():
    assert supported_architectures() == [
        "DeepseekV32ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "GlmMoeDsaForCausalLM", "GptOssForCausalLM",
        "KimiK25ForConditionalGeneration", "Kimi_K25ForConditionalGeneration", "MiniMaxM2ForCausalLM", "MixtralForCausalLM",
        "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration",
    ]
    assert all(isinstance(spec, ArchitectureSpec) and spec.name == name for name, spec in ARCHITECTURES.items())
    assert get_architecture("MixtralForCausalLM") is get_architecture("MixtralForCausalLM")  # the same table every lookup
    with pytest.raises(TypeError):
        ARCHITECTURES["Foo"] = ARCHITECTURES["MixtralForCausalLM"]  # read only


def test_mixtral_fields(tiny_ckpt):
    cfg = load_model_config(tiny_ckpt("mixtral", tie_word_embeddings=True, sliding_window=5)[0])
    assert cfg.architecture == "MixtralForCausalLM"
    assert (cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size) == (8, 2, 128)
    assert cfg.norm_topk_prob and cfg.tie_word_embeddings and cfg.sliding_window == 5
    assert cfg.head_dim == 16 and cfg.num_kv_heads == 2 and cfg.rope_theta == 10000.0
    assert cfg.eos_token_ids == (2,) and cfg.moe_layers == (0, 1)


def test_qwen3_dense_layers_and_window(tiny_ckpt):
    path, _ = tiny_ckpt("qwen3_moe", norm_topk_prob=False, decoder_sparse_step=2, tie_word_embeddings=True, use_sliding_window=True, sliding_window=6)
    cfg = load_model_config(path)
    assert not cfg.norm_topk_prob and cfg.qk_norm and cfg.sliding_window == 6
    assert cfg.moe_layers == (1,) and not cfg.is_moe_layer(0)
    path2, _ = tiny_ckpt("qwen3_moe", mlp_only_layers=[0])
    cfg2 = load_model_config(path2)
    assert cfg2.moe_layers == (1,) and cfg2.mlp_only_layers == (0,) and cfg2.sliding_window is None


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    with pytest.raises(ConfigError, match="unsupported architecture 'FooForCausalLM'.*MixtralForCausalLM.*Qwen3MoeForCausalLM"):
        load_model_config(tmp_path)


def test_missing_and_broken_config(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_model_config(tmp_path / "absent")
    with pytest.raises(ConfigError, match="config.json not found"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not readable JSON"):
        load_model_config(tmp_path)


def test_generation_config_eos_wins(tiny_ckpt, tmp_path):
    src, _ = tiny_ckpt("mixtral")
    raw = json.loads((src / "config.json").read_text())
    cfg = parse_model_config(raw, {"eos_token_id": [7, 9]})
    assert cfg.eos_token_ids == (7, 9)


def test_scaled_rope_is_refused_by_the_model(tiny_ckpt):
    from moemesh.checkpoint import CheckpointReader
    from moemesh.models.mixtral import MixtralForCausalLM

    path, _ = tiny_ckpt("mixtral")
    raw = json.loads((path / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    cfg = parse_model_config(raw)
    assert cfg.rope_scaling["rope_type"] == "yarn"
    with pytest.raises(ValueError, match="rope_scaling.*yarn"):
        MixtralForCausalLM(cfg, CheckpointReader(path), __import__("torch").float32)


def test_missing_required_field_is_named(tiny_ckpt):
    path, _ = tiny_ckpt("mixtral")
    raw = json.loads((path / "config.json").read_text())
    del raw["hidden_size"]
    with pytest.raises(ConfigError, match="lacks the field 'hidden_size'"):
        parse_model_config(raw)


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "MiniMaxM2ForCausalLM", "Qwen3NextForCausalLM", "KimiK25ForConditionalGeneration"])
@pytest.mark.parametrize("method", ["compressed-tensors", "gptq", "awq", None])
def test_quantization_formats_no_loader_reads_are_refused(arch, method):
    """Before any weight is read: a quantized weight read as plain would give wrong answers, not an error."""
    raw = {"architectures": [arch], "quantization_config": {"quant_method": method, "bits": 4}}
    with pytest.raises(ConfigError, match=r"quantization_config\.quant_method"):
        parse_model_config(raw)


def test_a_quantization_config_inside_text_config_is_checked_too():
    raw = {"architectures": ["Qwen3_5MoeForConditionalGeneration"],
           "text_config": {"quantization_config": {"quant_method": "gptq"}}}
    with pytest.raises(ConfigError, match=r"text_config\.quantization_config\.quant_method 'gptq'"):
        parse_model_config(raw)
