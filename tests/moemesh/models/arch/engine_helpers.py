"""Run a tiny checkpoint through LLMEngine with its experts loaded by the engine's own loader."""
from __future__ import annotations

from pathlib import Path

from moemesh.engine.config import EngineConfig
from moemesh.engine.llm_engine import LLMEngine


def make_engine(path: Path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(path), **{"block_size": 4, "kv_cache_tokens": 512, **kw}))
