"""DeepSeek-V3.2 / GLM-5 config parsing: the cache slot holds the latent and the indexer key, GLM-5's
indexer schedule as transformers derives it, dense/sparse layers, and errors that name the field."""
from __future__ import annotations

import pytest
import transformers as tf

from moemesh.config import ConfigError
from moemesh.models.registry import parse_model_config
from moemesh.models.deepseek_v32.config import DSAConfig, glm_indexer_types, mla_config
from tests.moemesh.models.tiny_families import tiny_config


def raw(name: str, arch: str, **overrides) -> dict:
    d = tiny_config(name).to_dict()
    d.update(architectures=[arch], **overrides)
    return d


def test_slot_holds_latent_and_indexer_key():
    cfg = parse_model_config(raw("deepseek_v32", "DeepseekV32ForCausalLM"))
    assert (cfg.num_kv_heads, cfg.head_dim) == (1, (24 + 8 + 16 + 1) // 2)
    dsa = DSAConfig.from_model_config(cfg)
    assert (dsa.index_topk, dsa.index_head_dim, dsa.index_n_heads, dsa.interleaved_rope) == (8, 16, 16, False)
    assert dsa.indexer_types == ("full",) * 3
    assert mla_config(cfg.raw).rope_interleave  # DSA's MLA rotates interleaved pairs whatever the config says


@pytest.mark.parametrize("kw", [{}, dict(index_topk_freq=2, index_skip_topk_offset=1), dict(index_topk_freq=3),
                                dict(index_topk_pattern="FSFFSS")])
def test_glm_indexer_schedule_matches_transformers(kw):
    hf = tf.GlmMoeDsaConfig(num_hidden_layers=6, **kw)
    d = hf.to_dict()
    d.pop("indexer_types")
    d.update(kw)
    assert glm_indexer_types(d, 6) == tuple(hf.indexer_types)


def test_mlp_layer_types_choose_the_dense_layers():
    cfg = parse_model_config(raw("deepseek_v32_plain", "DeepseekV32ForCausalLM"))
    assert cfg.moe_layers == (0, 2)


def test_dsa_without_q_lora_is_refused():
    with pytest.raises(ConfigError, match="q_lora_rank"):
        parse_model_config(raw("deepseek_v32", "DeepseekV32ForCausalLM", q_lora_rank=None))


def test_a_shared_first_layer_is_refused():
    with pytest.raises(ConfigError, match="indexer_types"):
        parse_model_config(raw("glm_moe_dsa", "GlmMoeDsaForCausalLM", indexer_types=["shared", "full", "full", "full"]))


def test_index_head_dim_below_rope_dims_is_refused():
    with pytest.raises(ConfigError, match="index_head_dim"):
        parse_model_config(raw("deepseek_v32", "DeepseekV32ForCausalLM", index_head_dim=4))
