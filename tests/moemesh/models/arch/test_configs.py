"""Config parsing for the three families: derived fields, older spellings (Kimi-K2's rope_scaling),
and errors that name the field."""
from __future__ import annotations

import pytest

from moemesh.config import ConfigError
from moemesh.models.deepseek_v3.config import GroupedGateConfig, MLAConfig
from moemesh.models.glm4_moe.config import rotary_dim
from moemesh.models.registry import parse_model_config
from tests.fixtures.checkpoints import tiny_config


def raw(arch: str, name: str, **overrides) -> dict:
    d = tiny_config(arch).to_dict()
    d.update(architectures=[name], **overrides)
    return d


def test_deepseek_fields():
    cfg = parse_model_config(raw("deepseek_v3", "DeepseekV3ForCausalLM", first_k_dense_replace=2))
    mla = MLAConfig.from_raw(cfg.raw)
    assert (cfg.num_kv_heads, cfg.head_dim) == (1, (mla.kv_lora_rank + mla.qk_rope_head_dim + 1) // 2)
    assert cfg.moe_layers == (2,) and cfg.num_experts == 16 and cfg.top_k == 4
    gate = GroupedGateConfig.from_raw(cfg.raw)
    assert (gate.n_group, gate.topk_group, gate.routed_scaling_factor, gate.n_shared_experts) == (4, 2, 2.5, 1)


def test_kimi_k2_style_config_with_rope_scaling():
    d = raw("deepseek_v3", "DeepseekV3ForCausalLM", model_type="kimi_k2", rope_theta=50000.0, scoring_func="sigmoid",
            rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                          "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    d.pop("rope_parameters")
    mla = MLAConfig.from_raw(parse_model_config(d).raw)
    assert mla.rope["rope_type"] == "yarn" and mla.rope["rope_theta"] == 50000.0 and mla.rope["factor"] == 32.0


def test_softmax_scoring_is_refused():
    with pytest.raises(ConfigError, match="scoring_func"):
        parse_model_config(raw("deepseek_v3", "DeepseekV3ForCausalLM", scoring_func="softmax"))


def test_glm_partial_rotary_defaults_to_half():
    d = raw("glm4_moe", "Glm4MoeForCausalLM")
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    assert rotary_dim(parse_model_config(d)) == 8  # head_dim 16


def test_glm_odd_rotary_dims_are_refused():
    d = raw("glm4_moe", "Glm4MoeForCausalLM")
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.3125}
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        parse_model_config(d)
