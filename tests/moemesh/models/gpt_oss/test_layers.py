"""gpt-oss layers vs transformers: sink attention (sliding and full, prefill and decode over the paged
cache), the biased top-k-softmax router, and the fused on-disk experts through kernels' grouped MLP."""
from __future__ import annotations

import pytest
import torch
from transformers.models.gpt_oss import modeling_gpt_oss as oss

from kernels import grouped_expert_mlp
from moemesh.config import ConfigError
from moemesh.engine.kv_cache import KVCache
from moemesh.models.deepseek_v3.config import rope_parameters
from moemesh.models.deepseek_v3.yarn_rope import build_rotary_table
from moemesh.models.gpt_oss.experts import load_gpt_oss_experts
from moemesh.models.gpt_oss.router import topk_softmax_router
from moemesh.models.gpt_oss.sinks_attention import SinkAttentionWeights, sink_attention
from moemesh.models.registry import parse_model_config
from tests.moemesh.models.arch.modules import DictReader, causal_mask, decode_meta, model_config, prefill_meta
from tests.fixtures.checkpoints import tiny_config


def randomized(module):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
    return module.eval()


@pytest.mark.parametrize("layer_idx", [0, 1])  # layer 0 slides (window 4), layer 1 attends to everything
def test_sink_attention_matches_transformers(layer_idx):
    hf = tiny_config("gpt_oss")
    hf._attn_implementation = "eager"
    attn = randomized(oss.GptOssAttention(hf, layer_idx))
    cfg = model_config(hf)
    d, nh, kvh = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    sd = attn.state_dict()
    window = hf.sliding_window if hf.layer_types[layer_idx] == "sliding_attention" else None
    w = SinkAttentionWeights(
        qkv=torch.cat([sd["q_proj.weight"], sd["k_proj.weight"], sd["v_proj.weight"]]),
        qkv_bias=torch.cat([sd["q_proj.bias"], sd["k_proj.bias"], sd["v_proj.bias"]]),
        o=sd["o_proj.weight"], o_bias=sd["o_proj.bias"], sinks=sd["sinks"],
        num_heads=nh, num_kv_heads=kvh, head_dim=d, window=window,
    )
    rope = build_rotary_table(rope_parameters(cfg.raw), d, cfg.max_position_embeddings)
    kv = KVCache(1, 8, 4, kvh, d, torch.float32)
    x = torch.randn(10, cfg.hidden_size)
    cos, sin = oss.GptOssRotaryEmbedding(hf)(x, torch.arange(10)[None])
    with torch.no_grad():
        ref = attn(x[None], (cos, sin), causal_mask(10, window))[0][0]
        torch.testing.assert_close(sink_attention(x[:7], w, prefill_meta(7), rope, *kv.layers[0]), ref[:7], rtol=1e-5, atol=1e-5)
        for pos in range(7, 10):
            got = sink_attention(x[pos : pos + 1], w, decode_meta(pos), rope, *kv.layers[0])
            torch.testing.assert_close(got[0], ref[pos], rtol=1e-5, atol=1e-5)


def test_router_matches_transformers():
    hf = tiny_config("gpt_oss")
    router = randomized(oss.GptOssTopKRouter(hf))
    h = torch.randn(20, hf.hidden_size)
    _, ref_w, ref_ids = router(h)
    got = topk_softmax_router(h, router.weight.detach(), router.bias.detach(), hf.num_experts_per_tok)
    assert torch.equal(got.expert_ids, ref_ids)
    torch.testing.assert_close(got.weights, ref_w.detach())


def test_fused_experts_match_transformers():
    hf = tiny_config("gpt_oss")
    experts = randomized(oss.GptOssExperts(hf))
    cfg = model_config(hf)
    reader = DictReader(experts.state_dict(), "model.layers.0.mlp.experts.")
    picked = [5, 0, 11]
    w = load_gpt_oss_experts(reader, cfg, 0, picked, torch.float32)
    assert w.activation == "swiglu_oai"
    x = 3 * torch.randn(6, hf.hidden_size)  # large enough that the +-7 clamps bind
    with torch.no_grad():
        for i, e in enumerate(picked):  # each picked expert alone, weight 1
            ref = experts(x, torch.full((6, 1), e), torch.ones(6, 1))
            got = grouped_expert_mlp(x, torch.tensor([i]), torch.tensor([6]), w)
            # outputs reach ~100: float32 summation order alone moves them by ~2e-5 (transformers itself
            # is that far from a float64 evaluation), so the tolerance is float rounding at that scale
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())


@pytest.mark.parametrize("bad, field", [
    (dict(swiglu_limit=5.0), "swiglu_limit"),
    (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]), "layer_types"),
])
def test_unsupported_config_names_the_field(bad, field):
    raw = tiny_config("gpt_oss").to_dict()
    raw.update(architectures=["GptOssForCausalLM"], **bad)
    from moemesh.config import ModelConfig

    with pytest.raises(ConfigError, match=field):
        parse_model_config(raw)
