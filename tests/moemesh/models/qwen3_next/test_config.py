"""Qwen3-Next / Qwen3.5-MoE config parsing: layer kinds, MoE layers, the recurrent state each sequence
needs, a VL checkpoint's text model with its placeholder tokens, and refusals that name the field."""
from __future__ import annotations

import pytest

from moemesh.config import ConfigError
from moemesh.models.registry import parse_model_config
from moemesh.models.qwen3_next.config import HybridConfig
from tests.moemesh.models.tiny_families import tiny_config


def raw(name: str, arch: str, **overrides) -> dict:
    d = tiny_config(name).to_dict()
    d.update(architectures=[arch], **overrides)
    return d


def test_qwen3_next_fields():
    cfg = parse_model_config(raw("qwen3_next", "Qwen3NextForCausalLM"))
    hc = HybridConfig.from_model_config(cfg)
    assert hc.layer_types == ("linear_attention",) * 3 + ("full_attention",) and hc.linear_layers == (0, 1, 2)
    assert cfg.moe_layers == (0, 2, 3)  # mlp_only_layers [1]
    assert (hc.rotary_dim, hc.conv_dim, hc.shared_expert_intermediate_size) == (4, 2 * 2 * 8 + 4 * 8, 48)


def test_layer_types_from_full_attention_interval():
    d = raw("qwen3_next", "Qwen3NextForCausalLM", num_hidden_layers=6, full_attention_interval=3, mlp_only_layers=[])
    d.pop("layer_types")
    hc = HybridConfig.from_model_config(parse_model_config(d))
    assert hc.layer_types == ("linear_attention", "linear_attention", "full_attention") * 2


def test_qwen3_5_every_layer_moe_and_renormalised():
    cfg = parse_model_config(raw("qwen3_5_moe", "Qwen3_5MoeForCausalLM", norm_topk_prob=False, decoder_sparse_step=2))
    assert cfg.moe_layers == (0, 1, 2, 3) and cfg.norm_topk_prob


def test_vl_checkpoint_is_its_text_model_with_media_tokens():
    cfg = parse_model_config(raw("qwen3_5_moe_vl", "Qwen3_5MoeForConditionalGeneration"))
    assert cfg.num_layers == 4 and cfg.num_experts == 16 and cfg.media_token_ids == (248056, 248057)
    assert not cfg.tie_word_embeddings


@pytest.mark.parametrize("field,value", [
    ("linear_num_value_heads", 3),  # not a multiple of the key heads
    ("layer_types", ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}),
])
def test_refusals_name_the_field(field, value):
    name = "partial_rotary_factor" if field == "rope_parameters" else field.replace("linear_num_value_heads", "linear_num_key_heads")
    with pytest.raises(ConfigError, match=name):
        parse_model_config(raw("qwen3_next", "Qwen3NextForCausalLM", **{field: value}))

