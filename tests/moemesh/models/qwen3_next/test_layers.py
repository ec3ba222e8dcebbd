"""Qwen3-Next / Qwen3.5 layers against transformers' modules (float32, random weights):
  * Gated DeltaNet (both on-disk layouts: grouped in_proj_qkvz/ba, flat in_proj_qkv/z/b/a): a prefill
    then decode steps over the recurrent state, and two sequences decoding side by side in one batch;
  * gated full attention (output gate, zero-centred q/k norm, partial rotary) at prefill and decode;
  * the MoE block: softmax top-k routed experts plus the sigmoid-gated shared expert."""
from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35
from transformers.models.qwen3_next import modeling_qwen3_next as qn

from kernels import ExpertWeights
from moemesh.config import ModelConfig
from moemesh.models.registry import parse_model_config
from moemesh.engine.kv_cache import KVCache
from moemesh.engine.recurrent_state import RecurrentStateStore
from moemesh.models.batch import BatchMeta, SeqSlice
from moemesh.models.deepseek_v3.config import rope_parameters
from moemesh.models.deepseek_v3.yarn_rope import build_rotary_table
from moemesh.models.partial_rope import full_width_table, head_permutation
from moemesh.models.layers import rope_for_step
from moemesh.models.qwen3_next.config import HybridConfig
from moemesh.models.qwen3_next.gated_attention import gated_attention, load_gated_attention
from moemesh.models.qwen3_next.gated_deltanet import gated_deltanet, load_deltanet
from moemesh.models.qwen3_next.moe import load_sparse_moe, sparse_moe_block
from moemesh.models.recurrent_state import RecurrentStateSpec
from moemesh.models.stages import run_to_end
from moemesh.contracts.knobs import LayerKnobs
from moemesh.moe.layer_experts import LayerExperts
from moemesh.moe.local_experts import LocalExperts
from tests.moemesh.models.arch.modules import DictReader, causal_mask

BLOCK = 4
TOL = dict(rtol=2e-5, atol=2e-5)
FAMILIES = {
    "qwen3_next": (tf.Qwen3NextConfig, qn.Qwen3NextGatedDeltaNet, qn.Qwen3NextAttention, qn.Qwen3NextSparseMoeBlock,
                   qn.Qwen3NextRotaryEmbedding, "Qwen3NextForCausalLM"),
    "qwen3_5_moe": (tf.Qwen3_5MoeTextConfig, q35.Qwen3_5MoeGatedDeltaNet, q35.Qwen3_5MoeAttention,
                    q35.Qwen3_5MoeSparseMoeBlock, q35.Qwen3_5MoeTextRotaryEmbedding, "Qwen3_5MoeForCausalLM"),
}


def setup(family: str, **kw):
    cfg_cls, *_, arch = FAMILIES[family]
    hf = cfg_cls(vocab_size=64, hidden_size=48, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6, num_experts=8,
                 num_experts_per_tok=3, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                 max_position_embeddings=64, **kw)
    hf._attn_implementation = "eager"
    raw = hf.to_dict()
    raw["architectures"] = [arch]
    return hf, parse_model_config(raw)


def randomized(module):
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(0.1 * torch.randn_like(p) + (1.0 if "norm" in name else 0.0))
    return module.eval()


def state_store(cfg: ModelConfig, num_slots: int) -> RecurrentStateStore:
    hc = HybridConfig.from_model_config(cfg)
    spec = RecurrentStateSpec((0,), (hc.conv_dim, hc.conv_kernel - 1),
                              (hc.linear_num_value_heads, hc.linear_key_head_dim, hc.linear_value_head_dim))
    return RecurrentStateStore(spec, num_slots, torch.float32)


def meta(seqs: list[tuple[list[int], int, int]], blocks: int = 8) -> BatchMeta:
    """seqs: (token ids, start position, slot); sequence i owns blocks [i*blocks, (i+1)*blocks)."""
    return BatchMeta.build([SeqSlice(t, pos, list(range(i * blocks, (i + 1) * blocks)), state_slot=slot)
                            for i, (t, pos, slot) in enumerate(seqs)], BLOCK)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gated_deltanet_chunks_then_decodes_match_transformers(family):
    hf, cfg = setup(family)
    ref_mod = randomized(FAMILIES[family][1](hf, 0))
    w = load_deltanet(DictReader(ref_mod.state_dict(), "a."), "a", HybridConfig.from_model_config(cfg),
                      hf.hidden_size, hf.rms_norm_eps, torch.float32)
    store = state_store(cfg, 2)
    state = store.layers[0]
    state.conv.normal_()  # stale contents of a reused slot: a chunk at position 0 must not read them
    state.ssm.normal_()
    x = torch.randn(2, 12, hf.hidden_size)
    with torch.no_grad():
        ref = ref_mod(x)  # [2, 12, H]: two sequences, each from scratch
        got = gated_deltanet(x[0, :4], w, meta([(list(range(4)), 0, 1)]), state)
        torch.testing.assert_close(got, ref[0, :4], **TOL)
        # sequence 1's whole prompt beside sequence 0's second chunk, which continues from its slot's state
        got = gated_deltanet(torch.cat([x[1, :9], x[0, 4:7]]), w, meta([(list(range(9)), 0, 0), ([0] * 3, 4, 1)]), state)
        torch.testing.assert_close(got, torch.cat([ref[1, :9], ref[0, 4:7]]), **TOL)
        for step in range(3):  # both decode in one batch: slot 1 at 7.., slot 0 at 9..
            p0, p1 = 7 + step, 9 + step
            got = gated_deltanet(torch.stack([x[0, p0], x[1, p1]]), w, meta([([0], p0, 1), ([0], p1, 0)]), state)
            torch.testing.assert_close(got, torch.stack([ref[0, p0], ref[1, p1]]), **TOL)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("factor", [0.25, 1.0])
def test_gated_attention_prefill_then_decode_match_transformers(family, factor):
    hf, cfg = setup(family, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor})
    _, _, attn_cls, _, rope_cls, _ = FAMILIES[family]
    attn = randomized(attn_cls(hf, 1))
    hc = HybridConfig.from_model_config(cfg)
    perm = head_permutation(cfg.head_dim, hc.rotary_dim)
    w = load_gated_attention(DictReader(attn.state_dict(), "a."), "a", cfg, perm, torch.float32)
    table = full_width_table(build_rotary_table(rope_parameters(cfg.raw), hc.rotary_dim, 64), cfg.head_dim)
    kv = KVCache(1, 8, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    n = 9
    x = torch.randn(n, hf.hidden_size)
    pos = torch.arange(n)[None]
    cos, sin = rope_cls(hf)(x, pos.expand(3, 1, n) if family == "qwen3_5_moe" else pos)
    with torch.no_grad():
        ref = attn(x[None], (cos, sin), causal_mask(n))[0][0]
        m = meta([(list(range(6)), 0, -1)])
        got = gated_attention(x[:6], w, m, rope_for_step(table, m.positions, torch.float32), *kv.layers[0])
        torch.testing.assert_close(got, ref[:6], **TOL)
        for p in range(6, n):
            m = meta([([0], p, -1)])
            got = gated_attention(x[p : p + 1], w, m, rope_for_step(table, m.positions, torch.float32), *kv.layers[0])
            torch.testing.assert_close(got[0], ref[p], **TOL)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_block_with_gated_shared_expert_matches_transformers(family):
    hf, cfg = setup(family)
    block = randomized(FAMILIES[family][3](hf))
    sd = block.state_dict()
    moe = load_sparse_moe(DictReader(sd, "mlp."), "mlp", cfg, hf.shared_expert_intermediate_size, torch.float32)
    w = ExpertWeights(sd["experts.gate_up_proj"].clone(), sd["experts.down_proj"].clone())
    experts = LocalExperts({0: LayerExperts.hold(range(w.num_experts), w)})
    h = torch.randn(10, hf.hidden_size)
    with torch.no_grad():
        ref = block(h[None])[0]
        got = run_to_end(sparse_moe_block(h, 0, moe, cfg, LayerKnobs(0, None, 0.0), experts))
    torch.testing.assert_close(got, ref, **TOL)
