from __future__ import annotations

import pytest
import torch

from moemesh.demo_model import build_demo_model
from tests.fixtures.checkpoints import build_model, tiny_config
from tests.fixtures.tokenizers import make_tiny_tokenizer
from tests.moemesh.demo_model.tiny_gguf import write_tiny_llama_gguf


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    """The real demo model (SmolLM2-135M-Instruct as 8-expert Mixtral, fp32), built once per session."""
    return build_demo_model(tmp_path_factory.mktemp("demo") / "demo-smollm2-moe", dtype="float32")


@pytest.fixture(scope="session")
def demo_mixtral(demo_dir):
    import transformers

    return transformers.MixtralForCausalLM.from_pretrained(str(demo_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """(gguf path, reference LlamaForCausalLM, tokenizer dir) for a tiny random llama written as GGUF."""
    root = tmp_path_factory.mktemp("tiny_gguf")
    tok_dir = make_tiny_tokenizer(root / "tok")
    model = build_model(tiny_config("llama"))
    path = write_tiny_llama_gguf(model, tok_dir, root / "tiny.gguf", embd_qtype="Q8_0")
    # The reference sees the embedding the GGUF really holds (Q8_0 round trip).
    import gguf

    q = gguf.quants.quantize(model.model.embed_tokens.weight.detach().numpy(), gguf.GGMLQuantizationType.Q8_0)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)))
    return path, model, tok_dir
