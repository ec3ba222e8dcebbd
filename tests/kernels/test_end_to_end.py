"""End to end: tiny Mixtral / Qwen3 (and gpt-oss) checkpoints through `LLMEngine` with every experts
dtype, and checkpoints written in each native on-disk layout (scales from compressed-tensors/torchao)
served as stored.

Prompt logprobs with quantized experts are compared with the float32 checkpoint run as stored; the
mean absolute differences are printed (`pytest -s`) and bounded.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.formats.checks import pad_last
from moemesh.engine.config import EngineConfig
from moemesh.engine.llm_engine import LLMEngine
from moemesh.engine.sampling_params import SamplingParams
from tests.kernels.oracles import ct_fp8_block, torchao_mxfp4_floor, torchao_nvfp4

FORMATS = ("bf16", "fp8", "mxfp4", "nvfp4")
# Bounds on the mean |logprob difference| vs the float32 experts (measured: see the printed table).
MEAN_ABS_BOUND = {"bf16": 0.01, "fp8": 0.15, "mxfp4": 0.4, "nvfp4": 0.4}
EXPERT_WEIGHT_SUFFIXES = (".w1.weight", ".w2.weight", ".w3.weight", "_proj.weight")


def prompt():
    g = torch.Generator().manual_seed(123)
    return torch.randint(0, 512, (24,), generator=g).tolist()


def engine(path: Path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(path), block_size=4, kv_cache_tokens=256, **kw))


def prompt_logprobs(eng: LLMEngine) -> torch.Tensor:
    res = eng.generate([prompt()], SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=True))
    return torch.tensor(res[0].prompt_logprobs[1:], dtype=torch.float64)


def expert_formats(eng: LLMEngine) -> set[str]:
    return {lx.weights.fmt for lx in eng.experts.layers.values()}


@pytest.fixture(params=["mixtral", "qwen3_moe"])
def tiny(request, tiny_ckpt):
    path, _ = tiny_ckpt(request.param)
    return request.param, path


def test_experts_dtype_logprobs_close_to_float32(tiny):
    arch, path = tiny
    ref = prompt_logprobs(engine(path))
    diffs = {}
    for fmt in FORMATS:
        eng = engine(path, experts_dtype=fmt)
        assert expert_formats(eng) == {"dense" if fmt == "bf16" else fmt}
        diffs[fmt] = (prompt_logprobs(eng) - ref).abs().mean().item()
    print(f"\n{arch}: mean |prompt logprob - float32| " + ", ".join(f"{f} {d:.5f}" for f, d in diffs.items()))
    for fmt, d in diffs.items():
        assert 0 < d < MEAN_ABS_BOUND[fmt], (fmt, d)
    assert diffs["bf16"] < diffs["fp8"] < min(diffs["mxfp4"], diffs["nvfp4"])


def is_expert_weight(name: str) -> bool:
    return ".experts." in name and name.endswith(EXPERT_WEIGHT_SUFFIXES)


def write_native(src: Path, dst: Path, fmt: str) -> Path:
    """Copy a float32 checkpoint, storing every expert weight in `fmt`'s on-disk layout, quantized by
    the independent oracle (compressed-tensors for FP8, torchao for NVFP4)."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if not is_expert_weight(name):
            out[name] = t
            continue
        stem = name[: -len("weight")]
        if fmt == "fp8":
            scale, q, _ = ct_fp8_block(t)
            out[name], out[name + "_scale_inv"] = q, scale
        else:
            scale, packed, scale_2, _ = torchao_nvfp4(pad_last(t, 16))
            out[name], out[stem + "weight_scale"] = packed, scale
            out[stem + "weight_scale_2"], out[stem + "input_scale"] = scale_2.reshape(()), torch.tensor(1.0)
    save_file({k: v.contiguous() for k, v in out.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if fmt == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
    else:
        quant = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}
        (dst / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": quant}))
    (dst / "config.json").write_text(json.dumps(config))
    for extra in ("generation_config.json",):
        if (src / extra).exists():
            (dst / extra).write_text((src / extra).read_text())
    return dst


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_native_checkpoint_is_served_as_stored(tiny, fmt, tmp_path):
    arch, path = tiny
    native = write_native(path, tmp_path / f"{arch}-{fmt}", fmt)
    stored = engine(native)
    assert expert_formats(stored) == {fmt}
    w = next(iter(stored.experts.layers.values())).weights
    assert w.gate_up.segments == 2 and w.down.segments == 1
    # the same rule on load gives the same bytes, hence the same logprobs
    on_load = prompt_logprobs(engine(path, experts_dtype=fmt))
    assert torch.equal(prompt_logprobs(stored), on_load)
    # asking for another format does not re-quantize a quantized checkpoint
    again = engine(native, experts_dtype="mxfp4")
    assert expert_formats(again) == {fmt}
    assert torch.equal(prompt_logprobs(again), on_load)


def test_native_checkpoint_rejects_missing_quant_config(tiny, tmp_path):
    from moemesh.checkpoint import CheckpointError

    arch, path = tiny
    native = write_native(path, tmp_path / f"{arch}-nvfp4", "nvfp4")
    (native / "hf_quant_config.json").unlink()
    with pytest.raises(CheckpointError, match="NVFP4"):
        engine(native)


def write_gpt_oss_mxfp4(src: Path, dst: Path) -> Path:
    """gpt-oss layout: gate_up_proj [E, H, 2I] -> gate_up_proj_blocks [E, 2I, H/32, 16] + _scales, via torchao."""
    dst.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, t in load_file(src / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows = t.transpose(1, 2).contiguous()  # [E, N, K]
            blocks, scales = [], []
            for e in range(rows.shape[0]):
                s, packed, _ = torchao_mxfp4_floor(rows[e])
                blocks.append(packed.reshape(rows.shape[1], -1, 16))
                scales.append(s)
            out[name + "_blocks"], out[name + "_scales"] = torch.stack(blocks), torch.stack(scales)
        else:
            out[name] = t
    save_file({k: v.contiguous() for k, v in out.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    for f in ("config.json", "generation_config.json"):
        if (src / f).exists():
            (dst / f).write_text((src / f).read_text())
    return dst


def test_gpt_oss_mxfp4_checkpoint_through_the_generic_loader(tiny_ckpt, tmp_path):
    dense, _ = tiny_ckpt("gpt_oss", num_hidden_layers=2, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2)
    native = write_gpt_oss_mxfp4(dense, tmp_path / "oss-mxfp4")
    stored = engine(native)
    assert expert_formats(stored) == {"mxfp4"}
    on_load = engine(dense, experts_dtype="mxfp4")
    assert torch.equal(prompt_logprobs(stored), prompt_logprobs(on_load))
    diff = (prompt_logprobs(stored) - prompt_logprobs(engine(dense))).abs().mean().item()
    print(f"\ngpt-oss: mean |prompt logprob - float32| mxfp4 (stored) {diff:.5f}")
    assert 0 < diff < MEAN_ABS_BOUND["mxfp4"]


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4"])
def test_float32_checkpoint_computes_in_float32_on_the_dequantized_weights(tiny, fmt):
    from tests.kernels.test_grouped_mlp import reference

    _, path = tiny
    eng = engine(path, experts_dtype=fmt, dtype="float32")
    from moemesh.moe.dispatch import DispatchPlan

    layer, held = next(iter(eng.experts.layers.items()))
    w = held.weights
    assert w.fmt == fmt
    torch.manual_seed(0)
    x = torch.randn(6, w.hidden_size)
    ids, counts = torch.tensor([1, 4, 6]), torch.tensor([2, 0, 4])
    plan = DispatchPlan(torch.arange(6), torch.ones(6), ids, counts, capacity=None, dropped=0)  # each row its own token, weight 1
    out = eng.experts.submit(layer, x, plan)
    assert out.dtype == torch.float32
    ref = reference(x, ids, counts, w)
    assert (out.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


@pytest.mark.slow  # `moemesh run` as a process
def test_moemesh_run_experts_dtype_flag(tiny):
    import subprocess
    import sys

    _, path = tiny
    ids = ",".join(str(t) for t in prompt()[:12])

    def run(*extra):
        cmd = [sys.executable, "-m", "moemesh.cli.main", "run", "--model", str(path), "--prompt-ids", ids,
               "--max-new-tokens", "1", "--temperature", "0", "--json", *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return torch.tensor(json.loads(proc.stdout.strip().splitlines()[-1])["prompt_logprobs"][1:], dtype=torch.float64)

    ref, quantized = run(), run("--experts-dtype", "nvfp4")
    diff = (quantized - ref).abs().mean().item()
    assert 0 < diff < MEAN_ABS_BOUND["nvfp4"]
