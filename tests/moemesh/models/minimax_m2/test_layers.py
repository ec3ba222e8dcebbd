"""MiniMax-M2's layers against transformers' modules (float32, random weights): the attention (q/k norm
over all heads, partial rotary) at prefill and decode over the paged cache, and the router (sigmoid
scores, biased selection, renormalised weights) as the grouped gate runs it."""
from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.models.minimax_m2 import modeling_minimax_m2 as mm

from moemesh.models.registry import parse_model_config
from moemesh.engine.kv_cache import KVCache
from moemesh.models.deepseek_v3.grouped_topk import grouped_topk
from moemesh.models.minimax_m2.attention import MiniMaxAttention
from moemesh.models.minimax_m2.config import GATE
from tests.moemesh.models.arch.modules import DictReader, assert_prefill_then_decode, causal_mask, randomize_


def config(**kw):
    hf = tf.MiniMaxM2Config(vocab_size=64, hidden_size=64, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=3,
                            max_position_embeddings=64, bos_token_id=None, eos_token_id=None, **kw)
    hf._attn_implementation = "eager"
    raw = hf.to_dict()
    raw["architectures"] = ["MiniMaxM2ForCausalLM"]
    return hf, parse_model_config(raw)


@pytest.mark.parametrize("rot", [4, 8, 16])
def test_attention_prefill_then_decode_match_transformers(rot):
    hf, cfg = config(rotary_dim=rot)
    torch.manual_seed(0)
    attn = mm.MiniMaxM2Attention(hf, 0).eval()
    randomize_(attn)
    ours = MiniMaxAttention(cfg, torch.float32)
    w = ours.load(DictReader(attn.state_dict(), "a."), "a")
    kv = KVCache(1, 8, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    x = torch.randn(9, cfg.hidden_size)
    cos, sin = mm.MiniMaxM2RotaryEmbedding(hf)(x, torch.arange(9)[None])
    assert cos.shape[-1] == rot
    with torch.no_grad():
        ref = attn(x[None], (cos, sin), causal_mask(9))[0][0]
        assert_prefill_then_decode(lambda part, meta: ours(part, w, meta, kv.layers[0]), x, ref, prefill=6)


def test_router_is_the_grouped_gate_with_one_group():
    hf, _ = config()
    torch.manual_seed(1)
    router = mm.MiniMaxM2TopKRouter(hf)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
    bias = 0.1 * torch.randn(hf.num_local_experts)
    h = torch.randn(12, hf.hidden_size)
    with torch.no_grad():
        logits, ref_w, ref_ids = router(h, bias)
    got = grouped_topk(logits.float(), hf.num_experts_per_tok, GATE.n_group, GATE.topk_group, bias, True, GATE.routed_scaling_factor)
    order = ref_ids.argsort(dim=-1)  # transformers does not sort its top-k
    assert torch.equal(got.expert_ids.sort(dim=-1).values, ref_ids.gather(1, order))
    torch.testing.assert_close(got.weights.gather(1, got.expert_ids.argsort(dim=-1)), ref_w.gather(1, order))
