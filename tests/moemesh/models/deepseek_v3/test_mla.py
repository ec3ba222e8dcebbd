"""MLA over the latent cache vs transformers' DeepseekV3Attention: prefill (expanded form) and decode
steps (absorbed form), with and without q LoRA / interleaved rope; the cache holds only the latents."""
from __future__ import annotations

import pytest
import torch
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

from moemesh.engine.kv_cache import KVCache
from moemesh.models.deepseek_v3.config import MLAConfig
from moemesh.models.deepseek_v3.mla import LatentCache, absorbed_decode, expanded_prefill, mla_attention, queries
from moemesh.models.deepseek_v3.model import load_mla
from moemesh.models.deepseek_v3.yarn_rope import build_rotary_table
from tests.moemesh.models.arch.modules import DictReader, causal_mask, decode_meta, model_config, prefill_meta, randomize_
from tests.fixtures.checkpoints import tiny_config

VARIANTS = [{}, dict(q_lora_rank=None, rope_interleave=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4})]


def build(overrides):
    hf = tiny_config("deepseek_v3", **overrides)
    hf._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = ds.DeepseekV3Attention(hf, layer_idx=0).eval()
    randomize_(attn, lambda name: "layernorm" in name)
    cfg = model_config(hf)
    mla = MLAConfig.from_raw(cfg.raw)
    w = load_mla(DictReader(attn.state_dict(), "a."), "a", cfg, mla, torch.float32)
    return hf, attn, cfg, mla, w


def reference(hf, attn, x):
    """transformers on the whole sequence x [n, H] -> [n, H]."""
    n = x.shape[0]
    cos, sin = ds.DeepseekV3RotaryEmbedding(hf)(x, torch.arange(n)[None])
    with torch.no_grad():
        return attn(x[None], (cos, sin), causal_mask(n))[0][0]


@pytest.mark.parametrize("overrides", VARIANTS)
def test_prefill_then_decode_match_transformers(overrides):
    hf, attn, cfg, mla, w = build(overrides)
    rope = build_rotary_table(mla.rope, mla.qk_rope_head_dim, cfg.max_position_embeddings)
    kv = KVCache(1, 8, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    cache = LatentCache(*kv.layers[0], w.latent_dim)
    x = torch.randn(9, cfg.hidden_size)
    ref = reference(hf, attn, x)
    with torch.no_grad():
        got = mla_attention(x[:6], w, prefill_meta(6), rope, cache)  # expanded form
        torch.testing.assert_close(got, ref[:6], rtol=1e-5, atol=1e-5)
        for pos in range(6, 9):  # absorbed form over the cached latents
            got = mla_attention(x[pos : pos + 1], w, decode_meta(pos), rope, cache)
            torch.testing.assert_close(got[0], ref[pos], rtol=1e-5, atol=1e-5)


def test_cache_holds_normed_latent_and_rotated_rope_key_only():
    hf, attn, cfg, mla, w = build({})
    assert (cfg.num_kv_heads, cfg.head_dim) == (1, (mla.kv_lora_rank + mla.qk_rope_head_dim + 1) // 2)
    rope = build_rotary_table(mla.rope, mla.qk_rope_head_dim, cfg.max_position_embeddings)
    kv = KVCache(1, 8, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    cache = LatentCache(*kv.layers[0], w.latent_dim)
    x = torch.randn(5, cfg.hidden_size)
    with torch.no_grad():
        mla_attention(x, w, prefill_meta(5), rope, cache)
        kv_a = attn.kv_a_proj_with_mqa(x)
        c_kv = attn.kv_a_layernorm(kv_a[:, : mla.kv_lora_rank])
        cos, sin = ds.DeepseekV3RotaryEmbedding(hf)(x, torch.arange(5)[None])
        k_pe = ds.apply_rotary_pos_emb_interleave(kv_a[None, None, :, mla.kv_lora_rank:], kv_a[None, None, :, mla.kv_lora_rank:], cos, sin)[0][0, 0]
    latents = cache.gather(torch.tensor([[0, 1]]))[0, :5]  # [5, R+Dr]
    torch.testing.assert_close(latents, torch.cat([c_kv, k_pe], dim=-1))


def test_absorbed_equals_expanded_on_the_same_keys():
    _, _, cfg, mla, w = build({})
    n, r = 7, mla.kv_lora_rank
    torch.manual_seed(1)
    q = queries(torch.randn(n, cfg.hidden_size), w)
    q_nope, q_pe = q[..., : mla.qk_nope_head_dim], q[..., mla.qk_nope_head_dim :]
    lat = torch.randn(n, w.latent_dim)
    expanded = expanded_prefill(q_nope, q_pe, lat[:, :r], lat[:, r:], w)  # [n, NH, Dv]
    mask = torch.ones(n, n, dtype=torch.bool).tril()  # query i sees keys <= i
    absorbed = absorbed_decode(q_nope, q_pe, w, lat[None].expand(n, -1, -1), mask)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-5, atol=1e-5)


def test_latent_cache_rejects_a_wrong_width():
    k = torch.zeros(2, 4, 1, 10)
    with pytest.raises(ValueError, match="latent cache"):
        LatentCache(k, k.clone(), 30)
