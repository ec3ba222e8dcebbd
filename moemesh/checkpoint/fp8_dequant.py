"""Non-expert weights of a BlockwiseFP8 checkpoint (`quant_method: fp8`, DeepSeek's layout): dequantized at
load, or kept as stored for a model that holds its dense linears in FP8 (`dense_dtype="fp8"`).

DeepSeek-V3 / Kimi-K2 FP8 checkpoints, and those of the other families published in the same format
(Qwen3-MoE, Qwen3-Next, MiniMax-M2, ...), store every linear layer except the embeddings, norms, router
and LM head as `weight float8_e4m3fn [N, K]` + `weight_scale_inv float32 [ceil(N/BN), ceil(K/BK)]`
(a multiplier; BN x BK = `quantization_config.weight_block_size`, edge blocks partial).
By default attention, dense-MLP and shared-expert weights are dequantized once at load into the compute
dtype; with `dense_dtype="fp8"` (`EngineConfig.dense_dtype`) they are handed over as stored
(`FP8BlockExperts` of one matrix, [1, N, K]), for `moemesh.models.layers.matmul_layout` to keep (no
dequantize and re-quantize). Routed experts stay FP8 and are served as stored
(moemesh.moe.expert_loader). Every model reads its non-expert weights through `weights_reader`."""
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
    """A CheckpointReader whose `get` returns FP8 block-quantized weights dequantized (same interface), or,
    with keep_stored, as stored (an `FP8BlockExperts` [1, N, K]; the dtype argument does not apply)."""

    def __init__(self, reader: CheckpointReader, block: tuple[int, int], keep_stored: bool = False) -> None:
        self.reader = reader
        self.block = block
        self.keep_stored = keep_stored

    def has(self, name: str) -> bool:
        return self.reader.has(name)

    def keys(self) -> list[str]:
        return self.reader.keys()

    def get(self, name: str, shape: Iterable[int] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        scale_name = name + SCALE_SUFFIX
        if not (name.endswith(".weight") and self.reader.has(scale_name)):
            return self.reader.get(name, shape=shape, dtype=dtype)
        w = fp8_block_from_checkpoint(self.reader.get(name, shape=shape), self.reader.get(scale_name), self.block)
        return w if self.keep_stored else w.dequantize(dtype or torch.float32)[0]


def weights_reader(
    reader: CheckpointReader, raw_config: dict[str, Any], dense_dtype: str | None = None
) -> CheckpointReader | DequantizingReader:
    """The reader a model takes its non-expert weights from: FP8-stored ones dequantized, or kept as
    stored where the model holds its dense linears in FP8 (dense_dtype "fp8")."""
    block = fp8_block_size(raw_config)
    return reader if block is None else DequantizingReader(reader, block, keep_stored=dense_dtype == "fp8")
