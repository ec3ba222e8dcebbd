from __future__ import annotations

import pytest
import torch

from moemesh.demo_model import build_demo_model


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    """The real demo model (SmolLM2-135M-Instruct as 8-expert Mixtral, fp32), built once per session."""
    return build_demo_model(tmp_path_factory.mktemp("demo") / "demo-smollm2-moe", dtype="float32")


@pytest.fixture(scope="session")
def demo_mixtral(demo_dir):
    import transformers

    return transformers.MixtralForCausalLM.from_pretrained(str(demo_dir), dtype=torch.float32).eval()
