"""`EngineConfig`: everything that shapes one in-process engine, with its defaults written once."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moemesh.engine.device import check_device

DTYPE_CHOICES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    """model_dir: Hugging Face model directory.
    dtype: compute dtype; "auto" = the checkpoint's dtype.
    experts_dtype: expert weight format (see kernels.prepare.EXPERT_DTYPES); None = as stored.
    block_size: tokens per KV cache block. kv_cache_tokens: KV cache capacity in tokens (all sequences).
    max_num_seqs: sequences per step. max_num_batched_tokens: tokens per step (the budget: the decodes
    first, then prompt chunks in what they leave; a longer prompt runs over several steps). max_model_len: None = the model's.
    prefix_cache: keep computed full KV blocks keyed by their token prefix and reuse them for later
    requests that start with the same tokens (automatic prefix caching).
    micro_batches: 1, or 2 to interleave two micro-batches layer by layer (ping-pong with remote experts).
    moe_top_k / capacity_factor: initial MoE knobs (None = the model's top-k; 0 = dropless).
    num_threads: torch intra-op threads (None = leave torch's default).
    pack_experts: also hold a oneDNN-packed copy of the experts for steps that route every token to
    every expert (CPU: bfloat16, or float32 with >= 2 threads); None = when the model's own top-k is its
    number of experts and the copy takes at most a quarter of the memory available at load (see
    moe.layer_experts.pack_by_default).
    device: where weights, KV cache and step tensors live: "cpu", "cuda" (the current CUDA device) or "cuda:N"."""

    model_dir: str
    dtype: str = "auto"
    experts_dtype: str | None = None
    block_size: int = 16
    kv_cache_tokens: int = 8192
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    micro_batches: int = 1
    moe_top_k: int | None = None
    capacity_factor: float = 0.0
    num_threads: int | None = 1
    pack_experts: bool | None = None
    device: str = "cpu"
    prefix_cache: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        for name in ("block_size", "kv_cache_tokens", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.micro_batches not in (1, 2):
            raise ValueError(f"micro_batches must be 1 or 2, got {self.micro_batches}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.moe_top_k is not None and self.moe_top_k < 1:
            raise ValueError(f"moe_top_k must be >= 1, got {self.moe_top_k}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.pack_experts not in (None, True, False):
            raise ValueError(f"pack_experts must be true, false or None (auto), got {self.pack_experts!r}")
        check_device(self.device)

    def compute_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        if self.dtype == "auto":
            return checkpoint_dtype if checkpoint_dtype in (torch.float32, torch.bfloat16) else torch.float32
        return torch.float32 if self.dtype == "float32" else torch.bfloat16
