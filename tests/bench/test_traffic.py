"""bench/traffic.py: the bytes a decode step must read, against the bytes in the checkpoint."""
from __future__ import annotations

import pytest
import torch

from bench.traffic import expected_distinct_experts, expert_bytes, step_bytes
from moemesh.checkpoint import CheckpointReader
from moemesh.models.registry import load_model_config


def test_expected_distinct_experts():
    assert expected_distinct_experts(64, 8, 1) == pytest.approx(8.0)
    assert expected_distinct_experts(8, 8, 16) == pytest.approx(8.0)  # top-k == E: every expert, every step
    assert expected_distinct_experts(64, 8, 16) == pytest.approx(64 * (1 - (56 / 64) ** 16))  # ~56.4
    assert expected_distinct_experts(64, 8, 0) == 0.0
    values = [expected_distinct_experts(64, 8, b) for b in range(1, 65)]
    assert all(a < b for a, b in zip(values, values[1:])) and values[-1] < 64
    with pytest.raises(ValueError, match="top_k"):
        expected_distinct_experts(8, 9, 1)


def test_step_bytes_add_up_to_the_checkpoint_tensors(tiny_shape_dir):
    """bf16 compute on the bf16 tiny checkpoint: attention and LM head are exactly those tensors'
    bytes; at batch 1 the experts are top-k experts' bytes per layer."""
    path = tiny_shape_dir("qwen3-sparse-tiny")
    cfg, reader = load_model_config(path), CheckpointReader(path)

    def nbytes(pred) -> int:
        return sum(reader.get(k).nbytes for k in reader.keys() if pred(k))

    one = expert_bytes(path, torch.bfloat16, None)
    assert one == nbytes(lambda k: ".mlp.experts.0." in k and k.startswith("model.layers.0."))
    t = step_bytes(cfg, torch.bfloat16, one, batch=1)
    assert t.attention == nbytes(lambda k: k.endswith("_proj.weight") and ".self_attn." in k)
    assert t.lm_head == nbytes(lambda k: k == "lm_head.weight")
    assert t.other == nbytes(lambda k: k.endswith("norm.weight") or k.endswith(".mlp.gate.weight"))
    assert t.experts == pytest.approx(cfg.num_layers * cfg.top_k * one)
    everything = nbytes(lambda k: True) - reader.get("model.embed_tokens.weight").nbytes
    all_experts = step_bytes(cfg, torch.bfloat16, one, batch=10_000)  # every expert read
    assert all_experts.total == pytest.approx(everything, rel=1e-6)
    assert step_bytes(cfg, torch.float32, expert_bytes(path, torch.float32, None), 1).total == pytest.approx(2 * t.total)
    assert "4.0 of 16 per layer" in t.describe()
    assert step_bytes(cfg, torch.bfloat16, one, batch=1, top_k=2).experts == pytest.approx(t.experts / 2)


def test_expert_bytes_follow_the_served_format(tiny_shape_dir):
    path = tiny_shape_dir("qwen3-sparse-tiny")
    cfg = load_model_config(path)
    weights = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert expert_bytes(path, torch.bfloat16, "bf16") == 2 * weights
    assert expert_bytes(path, torch.float32, None) == 4 * weights
    mxfp4 = expert_bytes(path, torch.bfloat16, "mxfp4")
    assert weights // 2 < mxfp4 <= weights // 2 + weights // 32 + 64  # 4-bit values + one e8m0 scale per 32
    assert weights < expert_bytes(path, torch.bfloat16, "fp8") < 2 * weights


def test_fp8_dense_bytes_are_what_the_engine_holds(tiny_shape_dir):
    from moemesh.engine import EngineConfig, LLMEngine
    from moemesh.models.layers import held_bytes

    path = tiny_shape_dir("qwen3-sparse-tiny")
    cfg = load_model_config(path)
    model = LLMEngine(EngineConfig(str(path), dtype="bfloat16", dense_dtype="fp8", kv_cache_tokens=64, max_num_seqs=1)).model
    t = step_bytes(cfg, torch.bfloat16, 0, batch=1, dense_dtype="fp8")
    assert t.attention == sum(held_bytes(lyr.attn.qkv) + held_bytes(lyr.attn.o) for lyr in model.layers)
    assert t.lm_head == held_bytes(model.lm_head)
    assert t.other == step_bytes(cfg, torch.bfloat16, 0, batch=1).other  # routers and norms stay bf16
