"""kernels.cpu.step_ops.decode_layer (kernels/cpu/csrc/decode_layer.cpp): a decoder layer's attention half
of a decode step in one call, against the decoder's ops called one by one; decode_layers_experts, that
call followed by the layer's experts for a run of MoE layers, against decode_layer and kernels.moe_mlp;
and the decoder taking them."""
import dataclasses

import pytest
import torch

from kernels import ExpertWeights, moe_mlp
from kernels.cpu import step_ops
from kernels.cpu.build import extension
from kernels.cpu.moe_mlp_cpu import MAX_ROWS_PER_EXPERT
from kernels.cpu.variant import VARIANT_ENV, available_variants
from moemesh.engine import EngineConfig, LLMEngine, SamplingParams
from moemesh.models import decoder
from moemesh.models.attention import AttentionWeights, attention
from moemesh.models.batch import BatchMeta, SeqSlice
from moemesh.models.layers import RotaryTable, add_rms_norm, linear, matmul_layout, rms_norm, rope_for_step
from moemesh.moe.dispatch import route
from moemesh.moe.local_experts import LocalExperts
from tests.kernels.cpu.test_cpu_kernels import weights as expert_weights

NH, KVH, D, H, E, BS = 4, 2, 32, 96, 8, 4
EPS = 1e-6


@pytest.fixture(autouse=True)
def compiled_or_skip():
    if not available_variants():
        pytest.skip("the compiled CPU kernels do not run here")


def make_layer(dtype, qk_norm: bool, bias: bool, router: bool, fp8: bool, seed: int = 0):
    """Random weights of one layer: (AttentionWeights, input norm, post norm, router or None)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape, s=0.1: (torch.randn(*shape, generator=g) * s).to(dtype)  # noqa: E731
    held = (lambda w: matmul_layout(w, dense_dtype="fp8")) if fp8 else (lambda w: w)
    attn = AttentionWeights(
        qkv=held(rnd((NH + 2 * KVH) * D, H)),
        o=held(rnd(H, NH * D)),
        num_heads=NH,
        num_kv_heads=KVH,
        head_dim=D,
        qkv_bias=rnd((NH + 2 * KVH) * D) if bias else None,
        q_norm=(1 + rnd(D)) if qk_norm else None,
        k_norm=(1 + rnd(D)) if qk_norm else None,
        norm_eps=EPS,
    )
    return attn, 1 + rnd(H), 1 + rnd(H), (rnd(E, H, s=1.0) if router else None)


def decode_batch(tokens: int, dtype, seed: int = 1):
    """A decode step of `tokens` sequences at different lengths, with caches holding random history."""
    g = torch.Generator().manual_seed(seed)
    slices = [SeqSlice([3 + i], 5 + 4 * i, list(range(4 * i, 4 * i + 4))) for i in range(tokens)]
    meta = BatchMeta.build(slices, BS)
    caches = [(torch.randn(4 * tokens + 1, BS, KVH, D, generator=g) * 0.5).to(dtype) for _ in range(2)]
    x = torch.randn(tokens, H, generator=g).to(dtype)
    residual = (torch.randn(tokens, H, generator=g) * 0.5).to(dtype)
    rope = RotaryTable.build(D, 10000.0, 64)
    return meta, caches, x, residual, rope, rope_for_step(rope, meta.positions, dtype)


def op_by_op(attn, in_norm, post_norm, router, x, residual, meta, rope, rope_cs, caches, top_k):
    """moemesh.models.decoder.MoeDecoderLM's path: norms, `attention`, then route(linear(h, router))."""
    if residual is None:
        h = rms_norm(x, in_norm, EPS)
    else:
        x, h = add_rms_norm(x, residual, in_norm, EPS)
    x, h = add_rms_norm(x, attention(h, attn, meta, rope, *caches, rope_cs), post_norm, EPS)
    plan = route(linear(h, router), top_k, True, E) if top_k else None
    return x, h, plan


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qk_norm,bias", [(True, False), (False, True), (False, False)])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("top_k", [0, 2])
def test_one_call_gives_the_op_by_op_values(dtype, qk_norm, bias, tokens, first, top_k):
    attn, in_norm, post_norm, router = make_layer(dtype, qk_norm, bias, router=top_k > 0, fp8=False)
    meta, caches, x, residual, rope, rope_cs = decode_batch(tokens, dtype)
    residual = None if first else residual
    layer = step_ops.decode_layer_weights(in_norm, post_norm, attn.qkv, attn.o, router, attn.qkv_bias, attn.qk_norm, NH, KVH, D, EPS, EPS)
    assert layer is not None
    want_caches = [c.clone() for c in caches]
    want = op_by_op(attn, in_norm, post_norm, router, x, residual, meta, rope, rope_cs, want_caches, top_k)
    got = step_ops.decode_layer(layer, x, residual, *rope_cs, *caches, meta.slot_mapping, meta.decode_block_tables, meta.decode_mask, top_k, True)
    assert got is not None
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(caches[0], want_caches[0]) and torch.equal(caches[1], want_caches[1])  # this step's k, v written
    if top_k:
        plan = want[2]
        for a, b in zip(got[2], (plan.token_idx, plan.weights, plan.expert_ids, plan.counts)):
            assert torch.equal(a, b)
    else:
        assert got[2] is None


def test_quantized_projections_are_read_in_place():
    """BlockwiseFP8 q/k/v and o (`dense_dtype="fp8"`) run inside the call, as `layers.linear` runs them."""
    attn, in_norm, post_norm, router = make_layer(torch.bfloat16, True, False, router=True, fp8=True)
    meta, caches, x, residual, rope, rope_cs = decode_batch(2, torch.bfloat16)
    layer = step_ops.decode_layer_weights(in_norm, post_norm, attn.qkv, attn.o, router, None, attn.qk_norm, NH, KVH, D, EPS, EPS)
    assert layer is not None and layer.max_rows == 16  # the router is plain bfloat16
    alone = step_ops.decode_layer_weights(in_norm, post_norm, attn.qkv, attn.o, None, None, attn.qk_norm, NH, KVH, D, EPS, EPS)
    assert alone.max_rows > 16  # quantized projections only: the kernels take them for more rows
    want = op_by_op(attn, in_norm, post_norm, router, x, residual, meta, rope, rope_cs, [c.clone() for c in caches], 3)
    got = step_ops.decode_layer(layer, x, residual, *rope_cs, *caches, meta.slot_mapping, meta.decode_block_tables, meta.decode_mask, 3, True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[2][0], want[2].token_idx)


def test_where_it_does_not_run_the_caller_runs_its_ops(monkeypatch):
    attn, in_norm, post_norm, router = make_layer(torch.bfloat16, True, False, router=True, fp8=False)
    args = (attn.qkv, attn.o, router, None, attn.qk_norm, NH, KVH, D, EPS, EPS)
    layer = step_ops.decode_layer_weights(in_norm, post_norm, *args)
    meta, caches, x, residual, _, rope_cs = decode_batch(1, torch.bfloat16)
    tail = (*rope_cs, *caches, meta.slot_mapping, meta.decode_block_tables, meta.decode_mask, 2, True)
    assert step_ops.decode_layer(layer, x.float(), residual.float(), *tail) is None  # another dtype than held
    many = torch.zeros(layer.max_rows + 1, H, dtype=torch.bfloat16)
    assert step_ops.decode_layer(layer, many, many, *tail) is None  # more rows than the kernels take: torch's GEMMs
    packed = torch.ops.mkldnn._reorder_linear_weight(attn.o.contiguous(), 1)
    assert step_ops.decode_layer_weights(in_norm, post_norm, attn.qkv, packed, *args[2:]) is None  # a oneDNN-packed matrix
    assert step_ops.decode_layer_weights(in_norm, post_norm, attn.qkv.float(), *args[1:]) is None  # a matrix of another dtype
    monkeypatch.setenv(VARIANT_ENV, "torch")
    assert step_ops.decode_layer_weights(in_norm, post_norm, *args) is None
    assert step_ops.decode_layer(layer, x, residual, *tail) is None  # the variant it was held for is no longer selected


def test_bad_input_is_a_value_error_naming_it():
    attn, in_norm, post_norm, router = make_layer(torch.bfloat16, True, False, router=False, fp8=False)
    with pytest.raises(ValueError, match="heads"):
        step_ops.decode_layer_weights(in_norm, post_norm, attn.qkv, attn.o, None, None, attn.qk_norm, NH, 3, D, EPS, EPS)
    layer = step_ops.decode_layer_weights(in_norm, post_norm, attn.qkv, attn.o, None, None, attn.qk_norm, NH, KVH, D, EPS, EPS)
    meta, caches, x, residual, _, rope_cs = decode_batch(1, torch.bfloat16)
    tail = (*rope_cs, *caches, meta.slot_mapping, meta.decode_block_tables, meta.decode_mask)
    with pytest.raises(ValueError, match="top_k"):
        step_ops.decode_layer(layer, x, residual, *tail, 2, True)  # no router to route with
    with pytest.raises(ValueError, match=r"x: expected \[T, 96\]"):
        step_ops.decode_layer(layer, x[:, :64].contiguous(), residual[:, :64].contiguous(), *tail, 0, True)
    with pytest.raises(ValueError, match="residual: expected the shape of x"):
        step_ops.decode_layer(layer, x, residual[:, :64].contiguous(), *tail, 0, True)


I = 40  # the experts' intermediate size


def moe_layer(dtype, fmt: str, bias: bool, seed: int = 0):
    """A MoE layer's `DecodeLayer` (its router routes over E experts) and its experts in `fmt`."""
    attn, in_norm, post_norm, router = make_layer(dtype, True, False, router=True, fp8=False, seed=seed)
    layer = step_ops.decode_layer_weights(in_norm, post_norm, attn.qkv, attn.o, router, None, attn.qk_norm, NH, KVH, D, EPS, EPS)
    return layer, expert_weights(fmt, dtype, H, I, bias=bias, e=E, seed=4 + seed)


@pytest.mark.parametrize("fmt,dtype,bias", [
    ("bf16", torch.bfloat16, True), ("f32", torch.float32, False), ("mxfp4", torch.bfloat16, True),
    ("nvfp4", torch.bfloat16, False), ("fp8", torch.bfloat16, False),
])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("layers", [1, 3])
def test_one_call_moe_layers_give_the_two_calls_values(fmt, dtype, bias, tokens, first, layers):
    """decode_layers_experts = per layer, decode_layer with routing, then kernels.moe_mlp on its plan,
    its output the next layer's residual; bit for bit, each layer's KV cache written."""
    held_layers = [moe_layer(dtype, fmt, bias, seed=j) for j in range(layers)]
    held = [step_ops.decode_experts_weights(w) for _, w in held_layers]
    assert all(layer is not None for layer, _ in held_layers) and all(h is not None for h in held)
    meta, _, x, residual, _, rope_cs = decode_batch(tokens, dtype)
    caches = [decode_batch(tokens, dtype, seed=10 + j)[1] for j in range(layers)]
    residual = None if first else residual
    top_ks = [3, 1, 2][:layers]
    want_caches = [[c.clone() for c in kv] for kv in caches]
    want_x, want_out = x, residual
    for (layer, w), kv, top_k in zip(held_layers, want_caches, top_ks):
        want_x, h, plan = step_ops.decode_layer(layer, want_x, want_out, *rope_cs, *kv, meta.slot_mapping, meta.decode_block_tables,
                                                meta.decode_mask, top_k, True)
        want_out = moe_mlp(h, *plan, w)  # [T, H]
    got = step_ops.decode_layers_experts(
        [layer for layer, _ in held_layers], held, x, residual, *rope_cs, [kv[0] for kv in caches], [kv[1] for kv in caches],
        meta.slot_mapping, meta.decode_block_tables, meta.decode_mask, top_ks, True,
    )
    assert got is not None
    assert torch.equal(got[0], want_x) and got[1].dtype == dtype and torch.equal(got[1], want_out)
    for kv, want_kv in zip(caches, want_caches):
        assert torch.equal(kv[0], want_kv[0]) and torch.equal(kv[1], want_kv[1])


def test_one_call_moe_layers_where_they_do_not_run(monkeypatch):
    layer, w = moe_layer(torch.bfloat16, "mxfp4", False)
    held = step_ops.decode_experts_weights(w)
    meta, caches, x, residual, _, rope_cs = decode_batch(1, torch.bfloat16)
    args = (*rope_cs, [caches[0]], [caches[1]], meta.slot_mapping, meta.decode_block_tables, meta.decode_mask)
    call = step_ops.decode_layers_experts
    assert call([layer], [held], x, residual, *args, [0], True) is None  # no routing: no plan
    assert call([layer], [held], x.float(), residual.float(), *args, [2], True) is None  # another dtype
    many = torch.zeros(min(layer.max_rows, MAX_ROWS_PER_EXPERT) + 1, H, dtype=torch.bfloat16)
    assert call([layer], [held], many, many, *args, [2], True) is None  # more rows than the kernels take
    f32, _ = moe_layer(torch.float32, "f32", False)
    assert call([layer, f32], [held, held], x, residual, *args, [2, 2], True) is None  # a layer held for another dtype
    half = ExpertWeights(torch.zeros(E, 2 * I, H, dtype=torch.float16), torch.zeros(E, H, I, dtype=torch.float16))
    assert step_ops.decode_experts_weights(half) is None  # a dtype the kernels do not read
    monkeypatch.setenv(VARIANT_ENV, "torch")
    assert call([layer], [held], x, residual, *args, [2], True) is None  # the variant is no longer selected


def test_one_call_moe_layers_bad_input_is_a_value_error_naming_it():
    layer, w = moe_layer(torch.bfloat16, "bf16", False)
    held = step_ops.decode_experts_weights(w)
    fewer = step_ops.decode_experts_weights(expert_weights("bf16", torch.bfloat16, H, I, e=2))  # 2 experts, the router routes over 8
    meta, caches, x, residual, _, rope_cs = decode_batch(3, torch.bfloat16)
    tail = (meta.slot_mapping, meta.decode_block_tables, meta.decode_mask)
    one = ([caches[0]], [caches[1]], *tail)
    with pytest.raises(ValueError, match="expert_idx: indices must lie in"):
        step_ops.decode_layers_experts([layer], [fewer], x, residual, *rope_cs, *one, [8], True)
    with pytest.raises(ValueError, match="layers: expected as many experts"):
        step_ops.decode_layers_experts([layer, layer], [held], x, residual, *rope_cs, [caches[0]] * 2, [caches[1]] * 2, *tail, [2, 2], True)
    gu, dn = step_ops.decode_experts_weights(w).view[1:3]
    with pytest.raises(ValueError, match="inter"):
        extension().LayerExperts(gu, None, dn, None, 0, 0)


@pytest.mark.parametrize("overrides,runs", [
    (dict(mlp_only_layers=[0]), 1),  # a dense first layer, then one run of MoE layers
    (dict(num_hidden_layers=3, mlp_only_layers=[1]), 2),  # a dense layer between two runs
])
def test_the_decoder_takes_the_one_call_moe_layers_with_the_same_tokens(tiny_ckpt, monkeypatch, overrides, runs):
    """Greedy generation with the MoE layers' decode step in one call per run of consecutive MoE
    layers (experts held in process) and with the attention half and the experts as two calls per
    layer: the same tokens and log-probabilities, bit for bit."""
    ran = []

    def counted(layers, *args, **kwargs):
        out = step_ops.decode_layers_experts(layers, *args, **kwargs)
        ran.append(len(layers) if out is not None else 0)
        return out

    monkeypatch.setattr(decoder, "decode_layers_experts", counted)
    path, _ = tiny_ckpt("qwen3_moe", norm_topk_prob=True, **overrides)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, top_logprobs=2)
    engine = LLMEngine(EngineConfig(str(path), dtype="bfloat16", block_size=4, kv_cache_tokens=256, num_threads=1))
    prompts = [[5, 17, 301, 42, 9, 77, 123], [250, 3, 64]]
    one = engine.generate(prompts, params)
    moe_layers = sum(lyr.router is not None for lyr in engine.model.layers)
    assert len(ran) == 11 * runs and sum(ran) == 11 * moe_layers  # every decode step's MoE layers (11 steps after the prefill)
    monkeypatch.setattr(LocalExperts, "decode_kernels", lambda self, layer: None)
    two = engine.generate(prompts, params)
    assert len(ran) == 11 * runs
    for a, b in zip(one, two):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


@pytest.mark.parametrize("arch,overrides", [
    ("qwen3_moe", dict(norm_topk_prob=True, mlp_only_layers=[0])),
    ("mixtral", dict(sliding_window=5, num_experts_per_tok=3)),
])
def test_the_decoder_takes_it_on_decode_steps_with_the_same_tokens(tiny_ckpt, arch, overrides, monkeypatch):
    """Greedy generation with every layer's one-call attention half and with none: the same tokens and
    log-probabilities, bit for bit (prefill runs op by op in both). The experts are submitted apart
    (the one-call MoE layer is the test above)."""
    monkeypatch.setattr(LocalExperts, "decode_kernels", lambda self, layer: None)
    ran = []

    def counted(*args, **kwargs):
        out = step_ops.decode_layer(*args, **kwargs)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(decoder, "decode_layer", counted)
    path, _ = tiny_ckpt(arch, **overrides)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, top_logprobs=2)
    engine = LLMEngine(EngineConfig(str(path), dtype="bfloat16", block_size=4, kv_cache_tokens=256, num_threads=1))
    layers = engine.model.layers
    assert all(lyr.fused is not None for lyr in layers)
    prompts = [[5, 17, 301, 42, 9, 77, 123], [250, 3, 64]]
    fused = engine.generate(prompts, params)
    assert ran and all(ran)  # every decode step's layers ran in the one call
    engine.model.layers = [dataclasses.replace(lyr, fused=None) for lyr in layers]
    op_by_op = engine.generate(prompts, params)
    for a, b in zip(fused, op_by_op):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
