"""Non-expert weights of a BlockwiseFP8 checkpoint (`quant_method: fp8`, DeepSeek's layout), dequantized at load.

DeepSeek-V3 / Kimi-K2 FP8 checkpoints, and those of the other families published in the same format
(Qwen3-MoE, Qwen3-Next, MiniMax-M2, ...), store every linear layer except the embeddings, norms, router
and LM head as `weight float8_e4m3fn [N, K]` + `weight_scale_inv float32 [ceil(N/BN), ceil(K/BK)]`
(a multiplier; BN x BK = `quantization_config.weight_block_size`, edge blocks partial).
Decision: attention, dense-MLP and shared-expert weights are dequantized once at load into the compute
dtype (they are a small share of the bytes and run on the attention side); routed experts stay FP8
and are served as stored (moemesh.moe.expert_loader). Every model reads its non-expert weights through
`weights_reader`."""
from __future__ import annotations

from typing import Any, Iterable

import torch

from kernels.formats import fp8_block_from_checkpoint
from moemesh.checkpoint.reader import CheckpointReader

SCALE_SUFFIX = "_scale_inv"


def fp8_block_size(raw_config: dict[str, Any]) -> tuple[int, int] | None:
    """(BN, BK) when config.json declares DeepSeek FP8 (`quant_method: fp8`), else None."""
    q = raw_config.get("quantization_config") or {}
    if q.get("quant_method") != "fp8":
        return None
    block = q.get("weight_block_size") or (128, 128)
    if len(block) != 2 or min(int(b) for b in block) < 1:
        raise ValueError(f"quantization_config.weight_block_size must be two positive ints, got {block!r}")
    return int(block[0]), int(block[1])


class DequantizingReader:
    """A CheckpointReader whose `get` returns FP8 block-quantized weights dequantized (same interface)."""

    def __init__(self, reader: CheckpointReader, block: tuple[int, int]) -> None:
        self.reader = reader
        self.block = block

    def has(self, name: str) -> bool:
        return self.reader.has(name)

    def keys(self) -> list[str]:
        return self.reader.keys()

    def get(self, name: str, shape: Iterable[int] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        scale_name = name + SCALE_SUFFIX
        if not (name.endswith(".weight") and self.reader.has(scale_name)):
            return self.reader.get(name, shape=shape, dtype=dtype)
        w = fp8_block_from_checkpoint(self.reader.get(name, shape=shape), self.reader.get(scale_name), self.block)
        return w.dequantize(dtype or torch.float32)[0]


def weights_reader(reader: CheckpointReader, raw_config: dict[str, Any]) -> CheckpointReader | DequantizingReader:
    block = fp8_block_size(raw_config)
    return reader if block is None else DequantizingReader(reader, block)
