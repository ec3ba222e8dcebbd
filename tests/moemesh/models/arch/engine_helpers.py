"""Run a tiny checkpoint through LLMEngine (gpt-oss experts through their own loader)."""
from __future__ import annotations

from pathlib import Path

import torch

from moemesh.checkpoint import CheckpointReader
from moemesh.config import ModelConfig
from moemesh.engine.config import EngineConfig
from moemesh.engine.llm_engine import LLMEngine
from moemesh.models.gpt_oss.experts import load_gpt_oss_experts
from moemesh.moe.local_experts import LocalExperts


def gpt_oss_local_experts(path: Path, dtype: torch.dtype = torch.float32, experts_dtype: str | None = None) -> LocalExperts:
    cfg, reader = ModelConfig.from_model_dir(path), CheckpointReader(path)
    all_experts = range(cfg.num_experts)
    return LocalExperts({l: load_gpt_oss_experts(reader, cfg, l, all_experts, dtype, experts_dtype) for l in cfg.moe_layers})


def make_engine(path: Path, **kw) -> LLMEngine:
    cfg = ModelConfig.from_model_dir(path)
    experts = None
    if cfg.architecture == "GptOssForCausalLM":
        experts = gpt_oss_local_experts(path, experts_dtype=kw.get("experts_dtype"))
    return LLMEngine(EngineConfig(model_dir=str(path), block_size=4, kv_cache_tokens=512, **kw), expert_compute=experts)
