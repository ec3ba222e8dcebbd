"""GLM-4.5's attention (partial rotary as a permuted full-width rope, q/k norm, qkv bias): the same
attention as transformers' Glm4MoeAttention."""
from __future__ import annotations

import pytest
import torch
from transformers.models.glm4_moe import modeling_glm4_moe as glm

from moemesh.engine.kv_cache import KVCache
from moemesh.models.glm4_moe.attention import GlmAttention
from tests.moemesh.models.arch.modules import DictReader, assert_prefill_then_decode, causal_mask, model_config, randomize_
from tests.fixtures.checkpoints import tiny_config


@pytest.mark.parametrize("overrides", [{}, dict(use_qk_norm=False, attention_bias=False, partial_rotary_factor=0.25)])
def test_attention_matches_transformers(overrides):
    hf = tiny_config("glm4_moe", **overrides)
    hf._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = glm.Glm4MoeAttention(hf, layer_idx=0).eval()
    randomize_(attn)
    cfg = model_config(hf)
    ours = GlmAttention(cfg, torch.float32)
    w = ours.load(DictReader(attn.state_dict(), "a."), "a")
    kv = KVCache(1, 8, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    x = torch.randn(9, cfg.hidden_size)
    cos, sin = glm.Glm4MoeRotaryEmbedding(hf)(x, torch.arange(9)[None])
    with torch.no_grad():
        ref = attn(x[None], (cos, sin), causal_mask(9))[0][0]
        assert_prefill_then_decode(lambda part, meta: ours(part, w, meta, kv.layers[0]), x, ref, prefill=6)
