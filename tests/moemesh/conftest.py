"""Tiny random checkpoints shared by the engine tests, built once per session and cached by options."""
from __future__ import annotations

import pytest
import torch

from tests.fixtures.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """tiny_ckpt(arch, dtype=torch.float32, **config_overrides) -> (path, transformers model)."""
    cache: dict = {}

    def make(arch: str, dtype: torch.dtype = torch.float32, **overrides):
        key = (arch, str(dtype), tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-{str(dtype).split('.')[-1]}")
            cache[key] = make_tiny_checkpoint(arch, out, dtype=dtype, **overrides)
        return cache[key]

    return make
