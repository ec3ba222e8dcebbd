"""Helpers for testing single layers against transformers modules: a dict-backed reader and a batch
of one prefill (+ decode steps) over a fresh paged cache."""
from __future__ import annotations

import torch

from moemesh.config import ModelConfig
from moemesh.models.batch import BatchMeta, SeqSlice
from moemesh.models.registry import parse_model_config


class DictReader:
    """The CheckpointReader surface the loaders use, over a state dict with a name prefix."""

    def __init__(self, tensors: dict[str, torch.Tensor], prefix: str = "") -> None:
        self.tensors = {prefix + k: v.detach() for k, v in tensors.items()}

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name, shape=None, dtype=None):
        t = self.tensors[name]
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name}: shape {tuple(t.shape)} != {tuple(shape)}")
        return t if dtype is None else t.to(dtype)


def model_config(hf_config) -> ModelConfig:
    raw = hf_config.to_dict()
    raw["architectures"] = [hf_config.architectures[0]] if hf_config.architectures else [ARCH[hf_config.model_type]]
    return parse_model_config(raw)


ARCH = {"deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}

BLOCK = 4


def prefill_meta(n: int, blocks: int = 8) -> BatchMeta:
    return BatchMeta.build([SeqSlice(list(range(n)), 0, list(range(blocks)))], BLOCK)


def decode_meta(pos: int, blocks: int = 8) -> BatchMeta:
    return BatchMeta.build([SeqSlice([0], pos, list(range(blocks)))], BLOCK)


def causal_mask(n: int, window: int | None = None) -> torch.Tensor:
    """[1, 1, n, n] additive float mask (0 = attend, -inf = masked), transformers' eager convention."""
    i = torch.arange(n)
    ok = i[None, :] <= i[:, None]
    if window is not None:
        ok &= i[None, :] > i[:, None] - window
    return torch.zeros(n, n).masked_fill(~ok, float("-inf"))[None, None]


def randomize_(module: torch.nn.Module, is_norm=lambda name: "norm" in name) -> None:
    """A reference module's weights drawn from the current torch seed, in parameter order: norm
    weights (`is_norm(name)`) 1 plus normal noise of std 0.1, the rest normal of std 0.1."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if is_norm(name) else p.normal_(0, 0.1)


def assert_prefill_then_decode(step, x: torch.Tensor, ref: torch.Tensor, prefill: int, tol: float = 1e-5) -> None:
    """step(x_part [t, H], meta) -> [t, H] against ref [N, H]: positions [0, prefill) as one prefill,
    then each later position as a one-token decode."""
    torch.testing.assert_close(step(x[:prefill], prefill_meta(prefill)), ref[:prefill], rtol=tol, atol=tol)
    for pos in range(prefill, x.shape[0]):
        torch.testing.assert_close(step(x[pos : pos + 1], decode_meta(pos))[0], ref[pos], rtol=tol, atol=tol)
