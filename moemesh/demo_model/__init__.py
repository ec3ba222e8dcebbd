"""The demo model: SmolLM2-135M-Instruct (GGUF, from PyPI) rebuilt as an 8-expert Mixtral that
reproduces the dense model exactly (see DESIGN.md section 6)."""
from moemesh.demo_model.build import build_demo_model, ensure_demo_model, is_complete
from moemesh.demo_model.convert import convert_gguf_to_mixtral
from moemesh.demo_model.locate import default_demo_dir, find_demo_gguf
from moemesh.demo_model.split import merge_experts, split_dense_mlp

__all__ = [
    "build_demo_model",
    "convert_gguf_to_mixtral",
    "default_demo_dir",
    "ensure_demo_model",
    "find_demo_gguf",
    "is_complete",
    "merge_experts",
    "split_dense_mlp",
]
