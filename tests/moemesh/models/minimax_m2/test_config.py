"""MiniMax-M2 config parsing: the rotated dims from either spelling, every layer MoE, refusals that name
the field."""
from __future__ import annotations

import pytest

from moemesh.config import ConfigError
from moemesh.models.registry import parse_model_config
from moemesh.models.minimax_m2.config import rotary_dim
from tests.moemesh.models.tiny_families import tiny_config


def raw(**overrides) -> dict:
    d = tiny_config("minimax_m2").to_dict()
    d.update(architectures=["MiniMaxM2ForCausalLM"], **overrides)
    return d


def test_fields():
    cfg = parse_model_config(raw())
    assert rotary_dim(cfg) == 8 and cfg.moe_layers == (0, 1, 2) and (cfg.num_experts, cfg.top_k) == (16, 4)
    assert cfg.moe_intermediate_size == 32


def test_rotary_dim_from_partial_rotary_factor():
    d = raw(rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.25})
    d.pop("rotary_dim")
    assert rotary_dim(parse_model_config(d)) == 4


@pytest.mark.parametrize("field,value", [("scoring_func", "softmax"), ("attn_type_list", [1, 0, 1]), ("rotary_dim", 5)])
def test_unsupported_settings_are_refused(field, value):
    with pytest.raises(ConfigError, match=field):
        parse_model_config(raw(**{field: value}))
