"""GLM-4.5's attention (partial rotary as a permuted full-width rope, q/k norm, qkv bias): the same
attention as transformers' Glm4MoeAttention."""
from __future__ import annotations

import pytest
import torch
from transformers.models.glm4_moe import modeling_glm4_moe as glm

from moemesh.engine.kv_cache import KVCache
from moemesh.models.glm4_moe.attention import GlmAttention
from tests.moemesh.models.arch.modules import DictReader, causal_mask, decode_meta, model_config, prefill_meta
from tests.fixtures.checkpoints import tiny_config


@pytest.mark.parametrize("overrides", [{}, dict(use_qk_norm=False, attention_bias=False, partial_rotary_factor=0.25)])
def test_attention_matches_transformers(overrides):
    hf = tiny_config("glm4_moe", **overrides)
    hf._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = glm.Glm4MoeAttention(hf, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.1)
    cfg = model_config(hf)
    ours = GlmAttention(cfg, torch.float32)
    w = ours.load(DictReader(attn.state_dict(), "a."), "a")
    kv = KVCache(1, 8, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    x = torch.randn(9, cfg.hidden_size)
    cos, sin = glm.Glm4MoeRotaryEmbedding(hf)(x, torch.arange(9)[None])
    with torch.no_grad():
        ref = attn(x[None], (cos, sin), causal_mask(9))[0][0]
        torch.testing.assert_close(ours(x[:6], w, prefill_meta(6), kv.layers[0]), ref[:6], rtol=1e-5, atol=1e-5)
        for pos in range(6, 9):
            got = ours(x[pos : pos + 1], w, decode_meta(pos), kv.layers[0])
            torch.testing.assert_close(got[0], ref[pos], rtol=1e-5, atol=1e-5)
