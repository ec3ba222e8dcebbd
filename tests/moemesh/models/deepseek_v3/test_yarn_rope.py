"""YaRN / default rope tables and DeepSeek's mscale softmax scale vs transformers."""
from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

from moemesh.models.deepseek_v3.yarn_rope import (
    apply_rope_interleaved,
    build_rotary_table,
    mla_softmax_scale,
    rope_frequencies,
)

ROPES = [
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
     "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},  # DeepSeek-V3
    {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "original_max_position_embeddings": 4096,
     "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 1, "beta_slow": 1},  # Kimi-K2
    {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "original_max_position_embeddings": 4096,
     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},  # gpt-oss
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
     "mscale": 0.707, "mscale_all_dim": 0.8},
    {"rope_type": "default", "rope_theta": 10000.0},
]


@pytest.mark.parametrize("rope", ROPES)
def test_frequencies_and_attention_factor_match_transformers(rope):
    cfg = tf.DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=64, max_position_embeddings=163840,
                              rope_parameters=dict(rope))
    inv, factor = rope_frequencies(dict(rope), 64, 163840)
    if rope["rope_type"] == "default":
        ref_inv, ref_factor = ds.DeepseekV3RotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        ref_inv, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    torch.testing.assert_close(inv, ref_inv, rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor, rel=1e-12)
    # the softmax scale DeepSeek's attention uses
    assert mla_softmax_scale(192, dict(rope)) == pytest.approx(ds.yarn_apply_mscale(dict(rope), 192**-0.5), rel=1e-12)


def test_table_matches_rotary_module_and_interleaved_rotation():
    rope = dict(ROPES[3])
    cfg = tf.DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=8, max_position_embeddings=256,
                              rope_parameters=dict(rope))
    module = ds.DeepseekV3RotaryEmbedding(cfg)
    pos = torch.arange(0, 256, 7)
    cos_ref, sin_ref = module(torch.zeros(1, dtype=torch.float32), pos[None])
    table = build_rotary_table(rope, 8, 256)
    cos, sin = table.for_positions(pos, torch.float32)  # [T, 1, D]
    torch.testing.assert_close(cos[:, 0], cos_ref[0])
    torch.testing.assert_close(sin[:, 0], sin_ref[0])
    q, k = torch.randn(len(pos), 3, 8), torch.randn(len(pos), 1, 8)
    q_ref, k_ref = ds.apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_ref, sin_ref)
    torch.testing.assert_close(apply_rope_interleaved(q, cos, sin), q_ref[0].transpose(0, 1))
    torch.testing.assert_close(apply_rope_interleaved(k, cos, sin), k_ref[0].transpose(0, 1))


@pytest.mark.parametrize("bad, field", [({"rope_type": "longrope"}, "rope_type")])
def test_unsupported_rope_type_names_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        rope_frequencies({"rope_theta": 1e4, **bad}, 8, 64)
