"""`EngineConfig.dense_dtype="fp8"` on the standard decoder (Qwen3-MoE, Mixtral): the attention projections,
dense MLP and LM head held in BlockwiseFP8, quantized at load from a float checkpoint or kept as a
BlockwiseFP8 checkpoint stores them; outputs against transformers run on the same dequantized weights,
and against the engine that holds them in the compute dtype."""
from __future__ import annotations

import shutil

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from kernels.formats import FP8BlockExperts
from kernels.prepare import prepare_dense
from moemesh.checkpoint import CheckpointReader
from moemesh.engine.config import EngineConfig
from moemesh.models.partial_rope import permute_heads
from tests.fixtures.checkpoints import ARCHS, make_tiny_checkpoint
from tests.moemesh.models.arch.native_quant import write_fp8_block
from tests.moemesh.models.arch.reference import assert_logprobs_close, greedy, prompt_logprobs
from tests.moemesh.models.engine_vs_transformers import make_engine, run_prompts
from tests.moemesh.models.tiny_families import make_checkpoint as make_family_checkpoint

PROMPT = [5, 17, 301, 42, 9, 77, 123, 250, 3, 64, 11, 200, 100, 50, 25, 12, 6, 3, 1, 0]


def fp8_round_trip(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> the values `prepare_dense(w, "fp8")` holds, as float32."""
    return prepare_dense(w, "fp8").dequantize(torch.float32)[0]


def fused_groups(names) -> list[list[str]]:
    """The dense linears of a checkpoint as the engine fuses them: q | k | v, gate | up, every other
    `*_proj.weight` alone; routed experts and routers left out."""
    groups = []
    for n in sorted(names):
        if ".experts." in n or not n.endswith(".weight"):
            continue
        stem, proj = n.rsplit(".", 2)[0], n.rsplit(".", 2)[1]
        if proj == "q_proj":
            groups.append([f"{stem}.{p}_proj.weight" for p in "qkv"])
        elif proj == "gate_proj":
            groups.append([f"{stem}.gate_proj.weight", f"{stem}.up_proj.weight"])
        elif proj in ("o_proj", "down_proj", "out_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa"):
            groups.append([n])  # (MLA's kv_b_proj stays plain)
        elif proj in ("in_proj_qkvz", "in_proj_qkv"):  # a Gated DeltaNet's input projections, fused in this order
            order = ("in_proj_qkvz", "in_proj_ba") if proj == "in_proj_qkvz" else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
            groups.append([f"{stem}.{p}.weight" for p in order])
    return groups


def write_dense_dequantized(src, dst):
    """A copy of the float checkpoint src whose dense linears hold the values the engine holds with
    dense_dtype "fp8": each fused group quantized as one matrix, and the LM head. (Where the engine also
    reorders rows, per head, the tiny models keep each block's set of rows, so the values match.)"""
    shutil.copytree(src, dst)
    t = load_file(str(src / "model.safetensors"))
    for names in fused_groups(t):
        parts = fp8_round_trip(torch.cat([t[n] for n in names])).split([t[n].shape[0] for n in names])
        t.update(zip(names, parts))
    t["lm_head.weight"] = fp8_round_trip(t["lm_head.weight"])  # untied checkpoints only
    save_file({k: v.contiguous() for k, v in t.items()}, str(dst / "model.safetensors"))
    return dst


def test_fp8_dense_engine_matches_transformers_on_the_dequantized_weights_and_the_float_engine(tmp_path):
    src, _ = make_tiny_checkpoint("qwen3_moe", tmp_path / "src", mlp_only_layers=[1])
    engine = make_engine(src, dense_dtype="fp8")
    model = engine.model
    lyr = model.layers[1]
    for w in (model.layers[0].attn.qkv, model.layers[0].attn.o, lyr.attn.qkv, lyr.mlp_gate_up, lyr.mlp_down, model.lm_head):
        assert isinstance(w, FP8BlockExperts) and w.shape[0] == 1 and w.block == (128, 128)
    assert isinstance(model.embed, torch.Tensor) and isinstance(model.layers[0].router, torch.Tensor)
    assert model.layers[0].router.dtype == torch.float32

    ref = tf.AutoModelForCausalLM.from_pretrained(write_dense_dequantized(src, tmp_path / "deq"), dtype=torch.float32)
    res = run_prompts(engine, [PROMPT], 8)[0]
    assert_logprobs_close(res.prompt_logprobs, prompt_logprobs(ref.eval(), PROMPT))
    assert res.token_ids == greedy(ref, PROMPT, 8)

    # Against the float32 engine: e4m3 keeps 3 mantissa bits, so each weight moves by up to 1/16 of
    # itself (~3.6% RMS), and this tiny random model's logits (std-0.1 weights, no training to make them
    # robust) follow: its prompt logprobs (-8 to -5 nats) move by about 0.05 nats on average and 0.18 at
    # most. The bounds (0.1 mean, 0.3 worst) hold FP8-sized errors and fail on a wrong matrix.
    plain = run_prompts(make_engine(src), [PROMPT], 8)[0]
    diffs = [abs(a - b) for a, b in zip(res.prompt_logprobs[1:], plain.prompt_logprobs[1:])]
    assert sum(diffs) / len(diffs) < 0.1 and max(diffs) < 0.3


def family_checkpoint(family: str, out_dir):
    """A tiny checkpoint of `family`: tests/fixtures/checkpoints.py's families, else tiny_families.py's."""
    if family in ARCHS:
        return make_tiny_checkpoint(family, out_dir)
    return make_family_checkpoint(family, out_dir)


@pytest.mark.parametrize("family", ["glm4_moe", "minimax_m2", "gpt_oss", "qwen3_next", "deepseek_v3", "deepseek_v32"])
def test_other_families_hold_fp8_dense_weights(family, tmp_path):
    """GLM-4.5 (q/k rows permuted per head, q/k/v biases, a dense first layer, shared experts), MiniMax-M2,
    gpt-oss (biased projections, sink attention), Qwen3-Next (gated attention, Gated DeltaNet, shared
    expert) and DeepSeek-V3 / V3.2 (MLA with kv_b kept plain, the DSA indexer) against transformers on
    the same dequantized weights."""
    src, _ = family_checkpoint(family, tmp_path / "src")
    engine = make_engine(src, dense_dtype="fp8")
    model = engine.model
    attn = model.layers[-1].attn if family != "qwen3_next" else model.layers[-1].mixer
    attn = getattr(attn, "mla", attn)  # DeepSeek-V3.2's DSA weights hold the MLA ones
    projections = {"qwen3_next": ("qgkv", "o"), "deepseek_v3": ("q_a", "q_b", "kv_a", "o"), "deepseek_v32": ("q_a", "q_b", "kv_a", "o")}
    assert all(isinstance(getattr(attn, p), FP8BlockExperts) for p in projections.get(family, ("qkv", "o")))
    if family.startswith("deepseek"):  # absorbed per head: stays a plain tensor
        assert isinstance(attn.kv_b, torch.Tensor)
    assert model.weight_bytes() < make_engine(src).model.weight_bytes()
    assert isinstance(model.lm_head, FP8BlockExperts) and isinstance(model.embed, torch.Tensor)
    shared = [lyr.mlp.shared for lyr in model.layers if getattr(getattr(lyr, "mlp", None), "shared", None) is not None]
    assert all(isinstance(getattr(m, "mlp", m).gate_up, FP8BlockExperts) for m in shared)  # Qwen3-Next's in a SharedExpert

    ref = tf.AutoModelForCausalLM.from_pretrained(write_dense_dequantized(src, tmp_path / "deq"), dtype=torch.float32).eval()
    res = run_prompts(engine, [PROMPT], 8)[0]
    assert_logprobs_close(res.prompt_logprobs, prompt_logprobs(ref, PROMPT))
    assert res.token_ids == greedy(ref, PROMPT, 8)


def test_tied_embeddings_get_their_own_fp8_lm_head(tmp_path):
    src, _ = make_tiny_checkpoint("mixtral", tmp_path / "src", tie_word_embeddings=True)
    model = make_engine(src, dense_dtype="fp8").model
    assert isinstance(model.lm_head, FP8BlockExperts) and isinstance(model.embed, torch.Tensor)
    embed = CheckpointReader(src).get("model.embed_tokens.weight")
    assert torch.equal(model.embed, embed)
    assert torch.equal(model.lm_head.dequantize(torch.float32)[0], fp8_round_trip(embed))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "glm4_moe"])
def test_blockwise_fp8_checkpoint_keeps_the_stored_bytes(arch, tmp_path):
    """32 x 32 blocks: q | k | v joined in row segments; GLM's per-head row permutation stays within blocks."""
    src, _ = family_checkpoint(arch, tmp_path / "src")
    qdir, deq_dir = write_fp8_block(src, tmp_path / "fp8", (32, 32))
    engine = make_engine(qdir, dense_dtype="fp8")
    stored = CheckpointReader(qdir)
    a = "model.layers.1.self_attn"
    attn = engine.model.layers[1].attn
    q, k, v = (stored.get(f"{a}.{n}_proj.weight").view(torch.uint8) for n in "qkv")
    if arch == "glm4_moe":  # the same bytes, q and k rows in the permuted head order
        cfg, perm = engine.model_config, engine.model.attention.perm
        q, k = permute_heads(q, cfg.num_heads, perm), permute_heads(k, cfg.num_kv_heads, perm)
    assert torch.equal(attn.qkv.weight[0].view(torch.uint8), torch.cat([q, k, v]))
    assert torch.equal(attn.o.weight[0].view(torch.uint8), stored.get(f"{a}.o_proj.weight").view(torch.uint8))
    assert torch.equal(attn.o.scale[0], stored.get(f"{a}.o_proj.weight_scale_inv"))

    assert_matches_dequantized(engine, deq_dir)


def test_bad_dense_dtype_names_the_field():
    with pytest.raises(ValueError, match="dense_dtype"):
        EngineConfig(model_dir="unused", dense_dtype="int8")


def test_qwen3_next_refuses_to_requantize_a_blockwise_fp8_checkpoint(tmp_path):
    src, _ = family_checkpoint("qwen3_next", tmp_path / "src")
    qdir, _ = write_fp8_block(src, tmp_path / "fp8", (32, 32))
    with pytest.raises(ValueError, match="dense_dtype.*Qwen3NextForCausalLM on a BlockwiseFP8 checkpoint"):
        make_engine(qdir, dense_dtype="fp8")


def test_blockwise_fp8_mla_checkpoint_keeps_its_projections_and_dequantizes_kv_b(tmp_path):
    src, _ = make_tiny_checkpoint("deepseek_v3", tmp_path / "src")
    qdir, deq_dir = write_fp8_block(src, tmp_path / "fp8", (32, 32))
    engine = make_engine(qdir, dense_dtype="fp8")
    stored = CheckpointReader(qdir)
    a = "model.layers.1.self_attn"
    mla = engine.model.layers[1].attn
    for name, proj in (("q_a", "q_a_proj"), ("kv_a", "kv_a_proj_with_mqa"), ("o", "o_proj")):
        assert torch.equal(getattr(mla, name).weight[0].view(torch.uint8), stored.get(f"{a}.{proj}.weight").view(torch.uint8))
    deq = load_file(str(deq_dir / "model.safetensors"))
    torch.testing.assert_close(mla.kv_b, deq[f"{a}.kv_b_proj.weight"], rtol=0, atol=0)
    assert_matches_dequantized(engine, deq_dir)


def assert_matches_dequantized(engine, deq_dir):
    """The engine on a BlockwiseFP8 checkpoint against transformers on its dequantized copy. The
    checkpoint stores its LM head in float (as DeepSeek's and Qwen3's FP8 checkpoints do): the engine
    quantizes it at load, so the reference holds the same values."""
    deq = load_file(str(deq_dir / "model.safetensors"))
    deq["lm_head.weight"] = fp8_round_trip(deq["lm_head.weight"])
    save_file(deq, str(deq_dir / "model.safetensors"))
    ref = tf.AutoModelForCausalLM.from_pretrained(deq_dir, dtype=torch.float32).eval()
    res = run_prompts(engine, [PROMPT], 8)[0]
    assert_logprobs_close(res.prompt_logprobs, prompt_logprobs(ref, PROMPT))
    assert res.token_ids == greedy(ref, PROMPT, 8)
