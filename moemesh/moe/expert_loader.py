"""Load one MoE layer's experts from a checkpoint into `kernels.ExpertWeights`.

A checkpoint whose experts are stored in a quantized format is loaded as stored (never re-quantized):
  BlockwiseFP8  `weight` e4m3 + `weight_scale_inv`, config.json `quantization_config {quant_method: fp8,
                weight_block_size}` (DeepSeek)
  NVFP4         `weight` uint8 + `weight_scale` e4m3 + `weight_scale_2` (+ `input_scale`),
                `hf_quant_config.json` {quant_algo: NVFP4, group_size: 16} (ModelOpt; or config.json
                `quantization_config {quant_method: modelopt, quant_algo: NVFP4}`)
  MXFP4         gpt-oss fused `*_blocks` / `*_scales` (via moemesh.models.gpt_oss.experts)
Gate and up become one gate_up with two row segments that keep their own scales.

Besides one tensor per expert and projection, experts may be stored fused as transformers 5 holds them
in memory (Qwen3.5-MoE's published checkpoints): `mlp.experts.gate_up_proj [E, 2I, H]` (gate rows, then
up rows) and `mlp.experts.down_proj [E, H, I]`, dense. gpt-oss's fused layout differs ([E, H, 2I],
interleaved, with biases) and is told apart by its biases.

Shape legend: E experts loaded (in the order asked for), I expert intermediate, H hidden.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kernels import ExpertWeights
from kernels.formats import cat_fp8_block, cat_nvfp4, fp8_block_from_checkpoint, nvfp4_from_modelopt
from kernels.prepare import prepare_experts
from moemesh.checkpoint import CheckpointError, CheckpointReader
from moemesh.config import ModelConfig, read_json

FP8_SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True)
class ExpertLayout:
    """How one family names a layer's per-expert tensors on disk ({layer}, {expert} are filled in)."""

    prefix: str
    gate: str
    up: str
    down: str

    def names(self, layer: int, expert: int) -> tuple[str, str, str]:
        p = self.prefix.format(layer=layer, expert=expert)
        return f"{p}.{self.gate}.weight", f"{p}.{self.up}.weight", f"{p}.{self.down}.weight"


MIXTRAL_LAYOUT = ExpertLayout("model.layers.{layer}.block_sparse_moe.experts.{expert}", "w1", "w3", "w2")
QWEN_LAYOUT = ExpertLayout("model.layers.{layer}.mlp.experts.{expert}", "gate_proj", "up_proj", "down_proj")
LAYOUTS = (MIXTRAL_LAYOUT, QWEN_LAYOUT)


def find_layout(reader: CheckpointReader, layer: int, expert: int) -> ExpertLayout:
    for layout in LAYOUTS:
        if reader.has(layout.names(layer, expert)[0]):
            return layout
    tried = ", ".join(repr(l.names(layer, expert)[0]) for l in LAYOUTS)
    raise CheckpointError(f"no weights for layer {layer} expert {expert} in the checkpoint (looked for {tried})")


def fp8_block_size(raw_config: dict) -> tuple[int, int]:
    """(BN, BK) from config.json `quantization_config {quant_method: fp8, weight_block_size}`."""
    q = raw_config.get("quantization_config") or {}
    if q.get("quant_method") != "fp8":
        raise CheckpointError("experts carry weight_scale_inv but config.json has no quantization_config with quant_method 'fp8'")
    block = q.get("weight_block_size") or (128, 128)
    if len(block) != 2 or min(int(b) for b in block) < 1:
        raise CheckpointError(f"quantization_config.weight_block_size must be two positive ints, got {block!r}")
    return int(block[0]), int(block[1])


def check_nvfp4_config(reader: CheckpointReader, raw_config: dict) -> None:
    """hf_quant_config.json (or config.json quantization_config) must declare NVFP4 with group size 16."""
    q = read_json(reader.model_dir / "hf_quant_config.json", required=False).get("quantization") or {}
    if not q:
        q = raw_config.get("quantization_config") or {}
    algo, group = q.get("quant_algo"), int(q.get("group_size", 16))
    if algo != "NVFP4" or group != 16:
        raise CheckpointError(
            f"experts carry weight_scale_2 but the quantization config says quant_algo={algo!r}, group_size={group} "
            "(expected NVFP4, 16 in hf_quant_config.json)"
        )


def stored_format(reader: CheckpointReader, layout: ExpertLayout, layer: int, expert: int) -> str:
    """'fp8' | 'nvfp4' | 'dense': how one expert's weights are stored."""
    gate = layout.names(layer, expert)[0]
    if reader.has(gate + FP8_SCALE_SUFFIX):
        return "fp8"
    if reader.has(gate[: -len("weight")] + "weight_scale_2"):
        return "nvfp4"
    return "dense"


def is_gpt_oss_layout(reader: CheckpointReader, layer: int) -> bool:
    p = f"model.layers.{layer}.mlp.experts"
    return reader.has(f"{p}.gate_up_proj_blocks") or reader.has(f"{p}.gate_up_proj_bias")


def is_fused_layout(reader: CheckpointReader, layer: int) -> bool:
    """transformers 5's fused experts without biases (not gpt-oss's)."""
    return reader.has(f"model.layers.{layer}.mlp.experts.gate_up_proj") and not is_gpt_oss_layout(reader, layer)


def load_fused_experts(reader: CheckpointReader, layer: int, ids: list[int], inter: int, hidden: int, dtype: torch.dtype) -> ExpertWeights:
    """Experts `ids` from gate_up_proj [E, 2I, H] and down_proj [E, H, I] (dense)."""
    p = f"model.layers.{layer}.mlp.experts"
    gate_up = reader.get(f"{p}.gate_up_proj")
    down = reader.get(f"{p}.down_proj")
    for name, t, want in (("gate_up_proj", gate_up, (2 * inter, hidden)), ("down_proj", down, (hidden, inter))):
        if tuple(t.shape[1:]) != want or not t.is_floating_point() or t.element_size() < 2:
            raise CheckpointError(
                f"{p}.{name}: fused experts must be dense [E, {want[0]}, {want[1]}], got {t.dtype} {list(t.shape)}"
            )
    sel = torch.tensor(ids, dtype=torch.long)
    return ExpertWeights(gate_up=gate_up[sel].to(dtype).contiguous(), down=down[sel].to(dtype).contiguous())


def load_quantized_projection(reader: CheckpointReader, names: list[str], fmt: str, rows: int, cols: int, block):
    """One projection [G, rows, cols] of G experts as stored: FP8BlockExperts | NVFP4Experts."""
    if fmt == "fp8":
        weight = reader.get_stacked(names, shape=(rows, cols))  # [G, N, K] e4m3
        scale = reader.get_stacked([n + FP8_SCALE_SUFFIX for n in names])  # [G, NB, KB]
        return fp8_block_from_checkpoint(weight, scale, block)
    stems = [n[: -len("weight")] for n in names]
    kp = -(-cols // 16) * 16
    weight = reader.get_stacked(names, shape=(rows, kp // 2))  # [G, N, K/2]
    scale = reader.get_stacked([s + "weight_scale" for s in stems], shape=(rows, kp // 16))  # [G, N, K/16]
    scale_2 = torch.stack([reader.get(s + "weight_scale_2").float().reshape(()) for s in stems])  # [G]
    has_input = all(reader.has(s + "input_scale") for s in stems)
    inp = torch.stack([reader.get(s + "input_scale").float().reshape(()) for s in stems]) if has_input else None
    return nvfp4_from_modelopt(weight, scale, scale_2, inp, k=cols)


def load_expert_weights(
    reader: CheckpointReader,
    cfg: ModelConfig,
    layer: int,
    expert_ids: Sequence[int],
    dtype: torch.dtype,
    experts_dtype: str | None = None,
) -> ExpertWeights:
    """Experts `expert_ids` of decoder layer `layer`, stacked along E in that order.

    gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I]: dense in `dtype`, or, for a
    checkpoint stored in BlockwiseFP8 / NVFP4 / MXFP4, the stored format as is. With `experts_dtype`
    ("bf16", "fp8", ...) the result goes through `kernels.prepare.prepare_experts(w, experts_dtype, dtype)`,
    which quantizes dense weights and keeps quantized ones as stored.
    """
    ids = [int(e) for e in expert_ids]
    if not ids:
        raise ValueError("expert_ids must name at least one expert")
    for e in ids:
        if not 0 <= e < cfg.num_experts:
            raise ValueError(f"expert_ids: expert {e} is outside [0, {cfg.num_experts})")
    if not cfg.is_moe_layer(layer):
        raise ValueError(f"layer {layer} is not a MoE layer of this model")
    if is_gpt_oss_layout(reader, layer):
        from moemesh.models.gpt_oss.experts import load_gpt_oss_experts

        return load_gpt_oss_experts(reader, cfg, layer, ids, dtype, experts_dtype)
    hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
    if is_fused_layout(reader, layer):
        w = load_fused_experts(reader, layer, ids, inter, hidden, dtype)
        return w if experts_dtype is None else prepare_experts(w, experts_dtype, dtype)
    layout = find_layout(reader, layer, ids[0])
    fmts = {stored_format(reader, layout, layer, e) for e in ids}
    if len(fmts) != 1:
        raise CheckpointError(f"layer {layer}: experts {ids} mix stored formats {sorted(fmts)}")
    fmt = fmts.pop()
    if fmt != "dense":
        block = fp8_block_size(cfg.raw) if fmt == "fp8" else None
        if fmt == "nvfp4":
            check_nvfp4_config(reader, cfg.raw)
        names = list(zip(*(layout.names(layer, e) for e in ids)))  # (gate names, up names, down names)
        gate = load_quantized_projection(reader, list(names[0]), fmt, inter, hidden, block)
        up = load_quantized_projection(reader, list(names[1]), fmt, inter, hidden, block)
        down = load_quantized_projection(reader, list(names[2]), fmt, hidden, inter, block)
        gate_up = cat_fp8_block([gate, up]) if fmt == "fp8" else cat_nvfp4([gate, up])
        w = ExpertWeights(gate_up=gate_up, down=down)
        return w if experts_dtype is None else prepare_experts(w, experts_dtype, dtype)
    gate_up = torch.empty(len(ids), 2 * inter, hidden, dtype=dtype)  # [E, 2I, H]
    down = torch.empty(len(ids), hidden, inter, dtype=dtype)  # [E, H, I]
    reads = []  # straight from the file into place: no second copy
    for i, e in enumerate(ids):
        g, u, d = layout.names(layer, e)
        reads += [(g, gate_up[i, :inter]), (u, gate_up[i, inter:]), (d, down[i])]
    reader.read_all_into(reads)
    w = ExpertWeights(gate_up=gate_up, down=down)
    if experts_dtype is not None:
        w = prepare_experts(w, experts_dtype, dtype)
    return w
