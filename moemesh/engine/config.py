"""`EngineConfig`: everything that shapes one in-process engine, with its defaults written once."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kernels.prepare import DENSE_DTYPES, EXPERT_DTYPES, check_dense_dtype
from moemesh.engine.device import check_device

DTYPE_CHOICES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    """One in-process engine: the model, its dtypes, the KV cache and batch bounds, MoE knobs, threads, device.

    Services that run an engine nest it (`AttentionConfig.engine`), and `moemesh run` builds it from
    its flags: `moemesh.svc_config` turns these fields into flags and environment overrides."""

    model_dir: str = field(metadata={"help": "Hugging Face model directory", "metavar": "DIR"})
    dtype: str = field(default="auto", metadata={"help": "compute dtype; auto = the checkpoint's", "choices": DTYPE_CHOICES})
    experts_dtype: str | None = field(default=None, metadata={"help": "expert weight format; unset = as stored", "choices": EXPERT_DTYPES})
    dense_dtype: str | None = field(default=None, metadata={
        "help": "format of the attention projections, dense MLPs, shared experts and LM head: fp8 = BlockwiseFP8 "
                "128x128 (quantized at load, or kept as a BlockwiseFP8 checkpoint stores them); unset = the compute "
                "dtype (embedding, router and norms always stay there)", "choices": DENSE_DTYPES})
    block_size: int = field(default=16, metadata={"help": "tokens per KV cache block"})
    kv_cache_tokens: int = field(default=8192, metadata={"help": "KV cache capacity in tokens (all sequences)"})
    max_num_seqs: int = field(default=64, metadata={"help": "sequences per step"})
    max_num_batched_tokens: int = field(default=4096, metadata={"help": "tokens per step: the decodes first, then prompt chunks in what they leave (a longer prompt runs over several steps)"})
    max_model_len: int | None = field(default=None, metadata={"help": "context length; unset = the model's"})
    micro_batches: int = field(default=1, metadata={
        "help": "1, or 2 to interleave two micro-batches layer by layer (ping-pong: attention of one while the other is "
                "at the experts; pays when expert servers have cores of their own)", "choices": (1, 2)})
    moe_top_k: int | None = field(default=None, metadata={"help": "experts per token; unset = the model's", "metavar": "K"})
    capacity_factor: float = field(default=0.0, metadata={
        "help": "experts' capacity: >0 capped at k*cf*tokens/E rows, 0 dropless, <0 dropless up to |cf|", "metavar": "CF"})
    num_threads: int | None = field(default=1, metadata={"help": "torch intra-op threads; unset = torch's default", "metavar": "N"})
    pack_experts: bool | None = field(default=None, metadata={
        "help": "also hold a oneDNN-packed copy of the experts for steps that route every token to every expert (CPU: "
                "bfloat16, or float32 with >= 2 threads); unset = when the model's own top-k is its number of experts and "
                "the copy takes at most a quarter of the memory available at load (moe.layer_experts.pack_by_default)"})
    all_experts_path: bool = field(default=True, metadata={
        "help": "steps that route every token to every expert (top-k = the number of experts) run the experts side "
                "by side as two matmuls (moe.layer_experts); off, every step runs kernels.moe_mlp"})
    device: str = field(default="cpu", metadata={"help": "where weights, KV cache and steps live: cpu, cuda (the current CUDA device) or cuda:N"})
    prefix_cache: bool = field(default=True, metadata={
        "help": "keep computed full KV blocks keyed by their token prefix and reuse them for later requests that start "
                "with the same tokens (automatic prefix caching)"})

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        for name in ("block_size", "kv_cache_tokens", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.experts_dtype is not None and self.experts_dtype not in EXPERT_DTYPES:
            raise ValueError(f"experts_dtype must be one of {EXPERT_DTYPES} (or unset), got {self.experts_dtype!r}")
        check_dense_dtype(self.dense_dtype)
        if self.micro_batches not in (1, 2):
            raise ValueError(f"micro_batches must be 1 or 2, got {self.micro_batches}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not math.isfinite(self.capacity_factor):
            raise ValueError(f"capacity_factor must be a finite number (0 = dropless), got {self.capacity_factor}")
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
