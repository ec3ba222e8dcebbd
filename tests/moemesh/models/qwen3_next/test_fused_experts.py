"""Qwen3.5-MoE checkpoints with fused experts on disk (mlp.experts.gate_up_proj [E, 2I, H], down_proj
[E, H, I], as the published checkpoints hold them): the experts load equal to the per-expert layout
transformers saves, and the model (text, and a VL checkpoint's text model) still matches transformers."""
from __future__ import annotations

import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moemesh.checkpoint import CheckpointReader
from moemesh.models.registry import load_model_config
from moemesh.moe.expert_loader import load_expert_weights
from tests.moemesh.models.arch.engine_helpers import make_engine
from tests.moemesh.models.arch.reference import assert_logprobs_close
from tests.moemesh.models.engine_vs_transformers import run_prompts
from tests.moemesh.models.tiny_families import PROMPTS

EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def fuse_experts(src, dst):
    """Copy a checkpoint with each layer's per-expert tensors stacked into gate_up_proj / down_proj."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out, parts = {}, {}
    for name, t in tensors.items():
        m = EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            parts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
    for prefix, experts in parts.items():
        ids = sorted(experts)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([experts[e]["gate"], experts[e]["up"]]) for e in ids])
        out[f"{prefix}.down_proj"] = torch.stack([experts[e]["down"] for e in ids])
    save_file(out, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("family_checkpoint", ["qwen3_5_moe", "qwen3_5_moe_vl"], indirect=True)
def test_fused_experts_load_and_serve_as_per_expert_ones(family_checkpoint, tmp_path):
    path, _, expected = family_checkpoint
    fused = fuse_experts(path, tmp_path / "fused")
    cfg = load_model_config(fused)
    for layer in cfg.moe_layers:
        a = load_expert_weights(CheckpointReader(path), cfg, layer, [5, 1, 9], torch.float32)
        b = load_expert_weights(CheckpointReader(fused), cfg, layer, [5, 1, 9], torch.float32)
        assert torch.equal(a.gate_up, b.gate_up) and torch.equal(a.down, b.down)
    res = run_prompts(make_engine(fused), PROMPTS[:1], new_tokens=4)[0]
    ref_plp, ref_tokens = expected[PROMPTS[0]]
    assert_logprobs_close(res.prompt_logprobs, ref_plp)
    assert res.token_ids == ref_tokens[:4]
