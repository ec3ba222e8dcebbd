"""Per-expert checkpoints in their native quantized layouts, loaded as stored into kernels.ExpertWeights
(DeepSeek-V3 / Kimi-K2 / GLM-4.5 naming: `model.layers.L.mlp.experts.J.{gate,up,down}_proj.*`).

Shape legend: G experts asked for, N output rows, K reduction dim, I intermediate, H hidden.

  BlockwiseFP8 (DeepSeek)  weight e4m3 [N, K] + weight_scale_inv f32 [ceil(N/BN), ceil(K/BK)]
  NVFP4 (ModelOpt)         weight uint8 [N, K/2] + weight_scale e4m3 [N, K/16] + weight_scale_2 f32 []
                           (+ input_scale f32 [])
  dense                    weight [N, K] (float), cast to the compute dtype
The gate and up projections become one gate_up [G, 2I, H] with two row segments (each keeps its own
scales), down is [G, H, I]; quantized tensors are not dequantized here.
"""
from __future__ import annotations

from typing import Sequence

import torch

from kernels import ExpertWeights
from kernels.formats import cat_fp8_block, cat_nvfp4, fp8_block_from_checkpoint, nvfp4_from_modelopt
from kernels.prepare import prepare_experts
from moemesh.checkpoint import CheckpointReader
from moemesh.config import ModelConfig
from moemesh.models.deepseek_v3.fp8_reader import SCALE_SUFFIX, fp8_block_size

FORMATS = ("dense", "fp8", "nvfp4")
PREFIX = "model.layers.{layer}.mlp.experts.{expert}"


def stored_format(reader: CheckpointReader, layer: int, expert: int) -> str:
    """'fp8' | 'nvfp4' | 'dense': how expert `expert` of `layer` is stored."""
    w = f"{PREFIX.format(layer=layer, expert=expert)}.gate_proj.weight"
    if reader.has(w + SCALE_SUFFIX):
        return "fp8"
    if reader.has(f"{PREFIX.format(layer=layer, expert=expert)}.gate_proj.weight_scale_2"):
        return "nvfp4"
    return "dense"


def load_projection(reader: CheckpointReader, names: list[str], fmt: str, rows: int, cols: int, block):
    """One projection of the G experts `names` (weight names): FP8BlockExperts | NVFP4Experts | None (dense)."""
    if fmt == "fp8":
        weight = torch.stack([reader.get(n, shape=(rows, cols)) for n in names])  # [G, N, K] e4m3
        scale = torch.stack([reader.get(n + SCALE_SUFFIX) for n in names])  # [G, NB, KB]
        return fp8_block_from_checkpoint(weight, scale, block)
    stem = [n[: -len("weight")] for n in names]
    weight = torch.stack([reader.get(n, shape=(rows, cols // 2)) for n in names])  # [G, N, K/2]
    scale = torch.stack([reader.get(s + "weight_scale", shape=(rows, cols // 16)) for s in stem])  # [G, N, K/16]
    scale_2 = torch.stack([reader.get(s + "weight_scale_2").float().reshape(()) for s in stem])  # [G]
    has_inp = all(reader.has(s + "input_scale") for s in stem)
    inp = torch.stack([reader.get(s + "input_scale").float().reshape(()) for s in stem]) if has_inp else None
    return nvfp4_from_modelopt(weight, scale, scale_2, inp, k=cols)


def load_native_experts(
    reader: CheckpointReader,
    cfg: ModelConfig,
    layer: int,
    expert_ids: Sequence[int],
    dtype: torch.dtype,
    experts_dtype: str | None = None,
) -> ExpertWeights:
    """Experts `expert_ids` of layer `layer`, in that order (same contract as
    `moemesh.moe.expert_loader.load_expert_weights`), quantized ones kept as stored."""
    ids = [int(e) for e in expert_ids]
    if not ids:
        raise ValueError("expert_ids must name at least one expert")
    for e in ids:
        if not 0 <= e < cfg.num_experts:
            raise ValueError(f"expert_ids: expert {e} is outside [0, {cfg.num_experts})")
    fmts = {stored_format(reader, layer, e) for e in ids}
    if len(fmts) != 1:
        raise ValueError(f"expert_ids: layer {layer} mixes stored formats {sorted(fmts)}")
    fmt = fmts.pop()
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    names = {p: [f"{PREFIX.format(layer=layer, expert=e)}.{p}_proj.weight" for e in ids] for p in ("gate", "up", "down")}
    if fmt == "dense":
        gate_up = torch.stack(
            [torch.cat([reader.get(g, shape=(inter, h), dtype=dtype), reader.get(u, shape=(inter, h), dtype=dtype)])
             for g, u in zip(names["gate"], names["up"])]
        )  # [G, 2I, H]
        down = torch.stack([reader.get(d, shape=(h, inter), dtype=dtype) for d in names["down"]])  # [G, H, I]
        w = ExpertWeights(gate_up, down)
    else:
        block = fp8_block_size(cfg.raw) if fmt == "fp8" else None
        if fmt == "fp8" and block is None:
            raise ValueError("config.json: FP8 experts need quantization_config {quant_method: fp8, weight_block_size}")
        gate = load_projection(reader, names["gate"], fmt, inter, h, block)
        up = load_projection(reader, names["up"], fmt, inter, h, block)
        gate_up = cat_fp8_block([gate, up]) if fmt == "fp8" else cat_nvfp4([gate, up])
        w = ExpertWeights(gate_up, load_projection(reader, names["down"], fmt, h, inter, block))
    return w if experts_dtype is None else prepare_experts(w, experts_dtype, dtype)
