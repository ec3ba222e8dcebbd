"""Rewrite a tiny float checkpoint into a native quantized on-disk layout, with quantized values and
scales from independent implementations (compressed-tensors for BlockwiseFP8, torchao for NVFP4 and
MXFP4; wrapped in tests/kernels/oracles.py). Each writer returns (quantized dir, dequantized dir): the
second is a float checkpoint holding the oracle's *dequantized* weights under the original names, which
transformers loads as the exact reference for the quantized one.

  write_fp8_block  DeepSeek-V3 FP8: every linear weight except embeddings, norms, router and LM head ->
                   weight e4m3 [N, K] + weight_scale_inv f32 [ceil(N/BN), ceil(K/BK)];
                   config.json quantization_config {quant_method: fp8, fmt: e4m3, weight_block_size}
  write_nvfp4      ModelOpt NVFP4 routed experts: weight uint8 [N, K/2], weight_scale e4m3 [N, K/16],
                   weight_scale_2 f32 [], input_scale f32 []; hf_quant_config.json + quantization_config
  write_mxfp4      gpt-oss MXFP4 experts: *_blocks uint8 [E, N, K/32, 16], *_scales uint8 [E, N, K/32]
                   (gate_up rows interleaved, as the bf16 tensor's columns are); quantization_config mxfp4
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.kernels.oracles import ct_fp8_block, torchao_mxfp4_floor, torchao_nvfp4

NOT_QUANTIZED = re.compile(r"(embed_tokens|norm|layernorm|lm_head|mlp\.gate\.|e_score_correction_bias)")
EXPERT_WEIGHT = re.compile(r"mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def _copy_dir(src: Path, dst: Path) -> dict:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, dst / f.name)
    return json.loads((src / "config.json").read_text())


def _write(src: Path, dst: Path, tensors: dict, config: dict, dequantized: dict) -> tuple[Path, Path]:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    deq_dir = dst.parent / (dst.name + "_dequantized")
    _copy_dir(src, deq_dir)
    save_file({k: v.contiguous() for k, v in dequantized.items()}, str(deq_dir / "model.safetensors"))
    return dst, deq_dir


def write_fp8_block(src: Path, dst: Path, block=(128, 128)) -> tuple[Path, Path]:
    config = _copy_dir(src, dst)
    out, deq = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        deq[name] = out[name] = w
        if name.endswith(".weight") and w.dim() == 2 and not NOT_QUANTIZED.search(name):
            scale, q, deq[name] = ct_fp8_block(w, block)
            out[name], out[name + "_scale_inv"] = q, scale.float().reshape(-(-w.shape[0] // block[0]), -(-w.shape[1] // block[1]))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    return _write(src, dst, out, config, deq)


def write_nvfp4(src: Path, dst: Path) -> tuple[Path, Path]:
    config = _copy_dir(src, dst)
    out, deq = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        deq[name] = out[name] = w
        if EXPERT_WEIGHT.search(name):
            scale, packed, scale_2, deq[name] = torchao_nvfp4(w)
            stem = name[: -len("weight")]
            out[name], out[stem + "weight_scale"] = packed, scale.view(torch.float8_e4m3fn)
            out[stem + "weight_scale_2"] = scale_2.float().reshape(())
            out[stem + "input_scale"] = torch.tensor(1.0 / 448.0)
    quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
             "exclude_modules": ["lm_head", "model.layers.*.self_attn*", "model.layers.*.mlp.gate", "model.layers.*.mlp.shared_experts*"]}
    (dst / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": quant}, indent=2))
    config["quantization_config"] = {"quant_method": "modelopt", **quant}
    return _write(src, dst, out, config, deq)


def write_mxfp4(src: Path, dst: Path) -> tuple[Path, Path]:
    config = _copy_dir(src, dst)
    out, deq = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not re.search(r"mlp\.experts\.(gate_up_proj|down_proj)$", name):
            deq[name] = out[name] = w
            continue
        rows = w.transpose(1, 2)  # [E, N, K]: gate_up [E, 2I, H] (rows interleaved), down [E, H, I]
        blocks, scales, values = [], [], []
        for e in range(rows.shape[0]):
            s, packed, d = torchao_mxfp4_floor(rows[e])
            blocks.append(packed.reshape(rows.shape[1], -1, 16))
            scales.append(s.reshape(rows.shape[1], -1))
            values.append(d)
        out[name + "_blocks"], out[name + "_scales"] = torch.stack(blocks), torch.stack(scales)
        deq[name] = torch.stack(values).transpose(1, 2)  # back to the on-disk float layout
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    return _write(src, dst, out, config, deq)
