"""Shared fixtures for the benchmarks' own code: tiny checkpoints written by bench/shapes.py."""
from __future__ import annotations

from dataclasses import replace

import pytest

from bench.shapes import DEMO, QWEN3_SPARSE_TINY, QWEN3_SPARSE_TINY_SKEW, ensure_checkpoint

# The demo model's family (Mixtral, tied embeddings) at test size.
MIXTRAL_TINY = replace(DEMO, hidden_size=64, num_layers=2, num_experts=8, top_k=2, expert_intermediate=32, num_heads=4,
                       num_kv_heads=2, head_dim=16)
TINY_SHAPES = {"qwen3-sparse-tiny": QWEN3_SPARSE_TINY, "mixtral-tiny": MIXTRAL_TINY, "qwen3-sparse-tiny-skew": QWEN3_SPARSE_TINY_SKEW}


@pytest.fixture(scope="session")
def tiny_shape_dir(tmp_path_factory):
    """tiny_shape_dir(name) -> the checkpoint of TINY_SHAPES[name], written once per session."""
    built = {}

    def make(name: str):
        if name not in built:
            built[name] = ensure_checkpoint(TINY_SHAPES[name], tmp_path_factory.mktemp("shapes") / name)
        return built[name]

    return make
