"""The DSA layers against transformers' modules (float32, random weights): the lightning indexer's
top-k selection (DeepseekV32Indexer, GlmMoeDsaIndexer) and DSA attention over the latent cache
(prefill, then decode steps, both past index_topk), for both families' rope layouts."""
from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as ds
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm

from moemesh.models.registry import parse_model_config
from moemesh.engine.kv_cache import KVCache
from moemesh.models.deepseek_v3.mla import LatentCache, mla_attention
from moemesh.models.deepseek_v3.yarn_rope import build_rotary_table
from moemesh.models.deepseek_v32.attention import DSAStep, dsa_attention
from moemesh.models.deepseek_v32.config import DSAConfig, mla_config
from moemesh.models.deepseek_v32.indexer import head_weights, index_keys, index_queries, index_scores, select_top_k
from moemesh.models.deepseek_v32.model import DeepseekV32ForCausalLM
from tests.moemesh.models.arch.modules import DictReader, causal_mask, decode_meta, prefill_meta, randomize_
from tests.fixtures.checkpoints import YARN_DEEPSEEK

TOPK = 5
N = 14  # tokens: a prefill of 9, then decode steps 9..13

FAMILIES = {
    "v32": (tf.DeepseekV32Config, ds.DeepseekV32Attention, ds.DeepseekV32RotaryEmbedding, "DeepseekV32ForCausalLM"),
    "glm5": (tf.GlmMoeDsaConfig, glm.GlmMoeDsaAttention, glm.GlmMoeDsaRotaryEmbedding, "GlmMoeDsaForCausalLM"),
}


def build(family: str):
    cfg_cls, attn_cls, rope_cls, arch = FAMILIES[family]
    hf = cfg_cls(vocab_size=64, hidden_size=64, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                 topk_group=1, q_lora_rank=32, kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
                 v_head_dim=12, index_topk=TOPK, index_head_dim=16, index_n_heads=16, max_position_embeddings=64,
                 rope_parameters=dict(YARN_DEEPSEEK, original_max_position_embeddings=16))
    hf._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = attn_cls(hf, 0).eval()
    randomize_(attn, lambda name: name.endswith("norm.weight"))
    raw = hf.to_dict()
    raw["architectures"] = [arch]
    cfg = parse_model_config(raw)
    model = DeepseekV32ForCausalLM.__new__(DeepseekV32ForCausalLM)  # only the attention loader is used
    model.cfg, model.dtype, model.dsa, model.mla = cfg, torch.float32, DSAConfig.from_model_config(cfg), mla_config(raw)
    model.dense_dtype = None
    w = model.load_attention(DictReader(attn.state_dict(), "a."), "a", 0)
    x = torch.randn(N, hf.hidden_size)
    cos, sin = rope_cls(hf)(x, torch.arange(N)[None])
    rope = build_rotary_table(model.mla.rope, hf.qk_rope_head_dim, hf.max_position_embeddings)
    return hf, attn, cfg, w, x, (cos, sin), rope


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_indexer_selects_the_same_keys_as_transformers(family):
    hf, attn, cfg, w, x, (cos, sin), rope = build(family)
    ix = attn.indexer
    with torch.no_grad():
        q_resid = attn.q_a_layernorm(attn.q_a_proj(x[None]))
        ref = ix(x[None], q_resid, (cos, sin), causal_mask(N)[:, 0], torch.arange(N)[None])[0]  # [N, TOPK]
        ref_mask = torch.zeros(N, N, dtype=torch.bool).scatter_(1, ref.long(), True) & torch.ones(N, N).tril().bool()
        c, s = rope.for_positions(torch.arange(N), torch.float32)
        keys = index_keys(x, w.indexer, c, s)
        q = index_queries(q_resid[0], w.indexer, c, s)
        scores = index_scores(q, head_weights(x, w.indexer), keys, w.indexer)  # [N, N]
        got = select_top_k(scores, torch.ones(N, N, dtype=torch.bool).tril(), TOPK)
    assert torch.equal(got, ref_mask)
    assert got.sum(-1).tolist() == [min(i + 1, TOPK) for i in range(N)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_attention_prefill_then_decode_match_transformers(family):
    hf, attn, cfg, w, x, (cos, sin), rope = build(family)
    kv = KVCache(1, 8, 4, 1, cfg.head_dim, torch.float32)
    cache = LatentCache(*kv.layers[0], w.mla.latent_dim + hf.index_head_dim)
    with torch.no_grad():
        ref = attn(x[None], (cos, sin), causal_mask(N), position_ids=torch.arange(N)[None])[0][0]
        meta = prefill_meta(9)
        got = dsa_attention(x[:9], w, meta, rope, cache, DSAStep.begin(meta, TOPK))  # expanded form, [9, 9] selection
        torch.testing.assert_close(got, ref[:9], rtol=1e-5, atol=1e-5)
        for pos in range(9, N):  # absorbed form over the cached latents, selected by the cached indexer keys
            meta = decode_meta(pos)
            got = dsa_attention(x[pos : pos + 1], w, meta, rope, cache, DSAStep.begin(meta, TOPK))
            torch.testing.assert_close(got[0], ref[pos], rtol=1e-5, atol=1e-5)


def test_selection_changes_the_output_past_index_topk():
    hf, attn, cfg, w, x, (cos, sin), rope = build("v32")
    kv = KVCache(1, 8, 4, 1, (w.mla.latent_dim + 1) // 2, torch.float32)
    with torch.no_grad():
        ref = attn(x[None], (cos, sin), causal_mask(N), position_ids=torch.arange(N)[None])[0][0]
        dense = mla_attention(x, w.mla, prefill_meta(N), rope, LatentCache(*kv.layers[0], w.mla.latent_dim))
    torch.testing.assert_close(dense[:TOPK], ref[:TOPK], rtol=1e-5, atol=1e-5)  # nothing to select yet
    assert (dense[TOPK:] - ref[TOPK:]).abs().max() > 1e-3


def test_shared_layer_without_a_full_layer_before_it_is_refused():
    hf, attn, cfg, w, x, _, rope = build("glm5")
    kv = KVCache(1, 8, 4, 1, cfg.head_dim, torch.float32)
    shared = type(w)(w.mla, None)
    with pytest.raises(ValueError, match="indexer_types"):
        meta = prefill_meta(4)
        dsa_attention(x[:4], shared, meta, rope, LatentCache(*kv.layers[0], w.mla.latent_dim + 16), DSAStep.begin(meta, TOPK))
