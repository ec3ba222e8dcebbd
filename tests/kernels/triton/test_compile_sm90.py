"""The grouped GEMM kernel compiles for a Hopper GPU (sm_90) on this CPU-only machine: Triton lowers
it to PTX and assembles a cubin, for every weight format, with bfloat16 compute (gate_up and down
launches) and float32 compute. This catches what the interpreter accepts but the compiler does not."""
import inspect

import pytest
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from kernels.triton.decode import FMT_DENSE, FMT_FP8, FMT_MXFP4, FMT_NVFP4
from kernels.triton.gemm import grouped_gemm_kernel
from kernels.triton.grouped_mlp import FP_FUSION, TILES_CUDA, TILES_CUDA_FLOAT32

SCALE_BLOCK = {FMT_DENSE: 1, FMT_FP8: 128, FMT_MXFP4: 32, FMT_NVFP4: 16}


def signature(fmt: int, xdt: str, constexprs: dict) -> dict:
    sig = {}
    for name in inspect.signature(grouped_gemm_kernel.fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ("x_ptr", "out_ptr", "b_ptr"):
            sig[name] = xdt
        elif name.startswith("tile_"):
            sig[name] = "*i32"
        elif name == "w_ptr":
            sig[name] = xdt if fmt == FMT_DENSE else "*u8"
        elif name == "s_ptr":
            sig[name] = "*fp32" if fmt == FMT_FP8 else "*u8"
        elif name == "s2_ptr":
            sig[name] = "*fp32"
        else:
            sig[name] = "i32"
    return sig


@pytest.mark.parametrize("fmt", [FMT_DENSE, FMT_FP8, FMT_MXFP4, FMT_NVFP4])
@pytest.mark.parametrize("xdt, gated", [("*bf16", True), ("*bf16", False), ("*fp32", True)])
def test_compiles_for_sm90(fmt, xdt, gated):
    bn, bk, warps = TILES_CUDA if xdt == "*bf16" else TILES_CUDA_FLOAT32
    constexprs = dict(
        QBK=SCALE_BLOCK[fmt], FMT=fmt, GATED=gated, ACT=1, HAS_BIAS=True, BF16=xdt == "*bf16", NATIVE_BF16_DOT=True,
        BM=16, BN=bn, BK=bk,
    )
    src = ASTSource(fn=grouped_gemm_kernel, signature=signature(fmt, xdt, constexprs), constexprs=constexprs)
    kernel = compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "enable_fp_fusion": FP_FUSION})
    assert ".entry grouped_gemm_kernel" in kernel.asm["ptx"]
    assert len(kernel.asm["cubin"]) > 0
