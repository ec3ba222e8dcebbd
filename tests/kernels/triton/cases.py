"""Checks of the Triton kernels, run on one device: CUDA in process, or CPU under TRITON_INTERPRET=1
in a subprocess (`python -m tests.kernels.triton.cases` prints the results as JSON).

Each case returns a number the tests compare with a bound: the largest difference found.
Shapes are tiny so the interpreter takes a few seconds.
"""
from __future__ import annotations

import json
import sys

import torch

from kernels import grouped_expert_mlp, prepare_experts
from kernels.formats import quantize_fp8_block, quantize_mxfp4, quantize_nvfp4
from tests.kernels.test_grouped_mlp import make_weights, reference

FORMATS = ("bf16", "fp8", "mxfp4", "nvfp4")


def _dump_tiles(t, device) -> torch.Tensor:
    """Every weight of expert-stacked `t` through load_weight_tile, as a dense [E, N, K] float32."""
    import triton

    from kernels.triton.grouped_mlp import format_args
    from tests.kernels.triton.dump_kernel import dump_kernel

    e, n, k = t.shape
    out = torch.zeros(e, n, k, device=device)
    fmt, w, s, s2, *ints = format_args(t, torch.float32)
    dump_kernel[(e, triton.cdiv(n, 16), triton.cdiv(k, 32))](out, w, s, s2, n, k, *ints[:10], QBK=ints[10], FMT=fmt, BN=16, BK=32)
    return out


def dequant_tile_cases(device) -> dict[str, float]:
    """Max |triton tile - torch dequantize| per format (exactness: expect 0), edge blocks included."""
    torch.manual_seed(0)
    w = torch.randn(2, 40, 72) * torch.rand(2, 40, 1) * 3
    w[1, :, 32:48] = 0.0  # all-zero blocks
    quantized = {
        "fp8": quantize_fp8_block(w, block=(8, 16), segments=2),
        "fp8_128": quantize_fp8_block(w, segments=2),
        "mxfp4": quantize_mxfp4(w),
        "nvfp4": quantize_nvfp4(w, segments=2),
    }
    res = {}
    for name, q in quantized.items():
        got = _dump_tiles(q.to(device), device).cpu()
        res[name] = (got - q.dequantize(torch.float32)).abs().max().item()
    return res


def mlp_cases(device) -> dict[str, float]:
    """Max error relative to the output scale, vs the float64 reference on the dequantized weights."""
    res = {}
    expert_idx = torch.tensor([3, 0, 2, 1])
    counts = torch.tensor([17, 0, 1, 3])  # more than one row tile, zero rows, a single row
    for fmt in FORMATS:
        for act, bias in (("silu", False), ("swiglu_oai", True)):
            w = prepare_experts(make_weights(e=4, h=48, i=40, bias=bias, activation=act, seed=5), fmt, torch.float32)
            torch.manual_seed(6)
            x = torch.randn(int(counts.sum()), 48)
            out = grouped_expert_mlp(x.to(device), expert_idx.to(device), counts.to(device), w.to(device), backend="triton")
            ref = reference(x, expert_idx, counts, w)
            res[f"{fmt}/{act}"] = (out.cpu().double() - ref).abs().max().item() / ref.abs().max().item()
    return res


def gpu_tile_cases(device) -> dict[str, float]:
    """The GPU tile sizes (wider than these tiny matrices: masks everywhere), relative error as in mlp_cases."""
    from kernels.triton.grouped_mlp import TILES_CUDA, TILES_CUDA_FLOAT32, grouped_expert_mlp_triton

    res = {}
    expert_idx, counts = torch.tensor([2, 0]), torch.tensor([3, 1])
    for fmt in FORMATS:
        w = prepare_experts(make_weights(e=3, h=40, i=24, seed=9), fmt, torch.float32)
        torch.manual_seed(10)
        x = torch.randn(4, 40)
        ref = reference(x, expert_idx, counts, w)
        for tiles in (TILES_CUDA, TILES_CUDA_FLOAT32):
            out = grouped_expert_mlp_triton(x.to(device), expert_idx.to(device), counts.to(device), w.to(device), tiles)
            res[f"{fmt}/{tiles}"] = (out.cpu().double() - ref).abs().max().item() / ref.abs().max().item()
    return res


def bf16_cases(device) -> dict[str, float]:
    """bfloat16 compute: max difference to the torch backend relative to the output scale."""
    res = {}
    expert_idx, counts = torch.tensor([1, 2]), torch.tensor([5, 1])
    for fmt in FORMATS:
        w = prepare_experts(make_weights(e=3, h=32, i=32, seed=7), fmt, torch.bfloat16)
        torch.manual_seed(8)
        x = torch.randn(6, 32).to(torch.bfloat16)
        out = grouped_expert_mlp(x.to(device), expert_idx.to(device), counts.to(device), w.to(device), backend="triton")
        ref = grouped_expert_mlp(x, expert_idx, counts, w, backend="torch")
        assert out.dtype == torch.bfloat16
        res[fmt] = (out.cpu().float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
    return res


def run_all(device: str) -> dict[str, dict[str, float]]:
    return {
        "dequant": dequant_tile_cases(device), "mlp": mlp_cases(device), "gpu_tiles": gpu_tile_cases(device),
        "bf16": bf16_cases(device),
    }


if __name__ == "__main__":
    json.dump(run_all(sys.argv[1] if len(sys.argv) > 1 else "cpu"), sys.stdout)
