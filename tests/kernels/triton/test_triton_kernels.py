"""The Triton grouped expert MLP against the torch path and the float64 reference.

On CPU the kernels run under TRITON_INTERPRET=1 in a subprocess (the variable must be set before the
kernels are defined, and must not leak into other tests); on CUDA they also run natively in process.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels.triton.cases import FORMATS

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.triton.cases", "cpu"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check(results):
    for name, err in results["dequant"].items():
        assert err == 0.0, f"dequantized tile differs for {name}: {err}"
    for name, rel in results["mlp"].items():
        assert rel <= 1e-5, f"{name}: relative error {rel}"
    for name, rel in results["gpu_tiles"].items():
        assert rel <= 1e-5, f"GPU tiles {name}: {rel}"
    assert len(results["gpu_tiles"]) == 2 * len(FORMATS)
    for fmt in FORMATS:
        assert results["bf16"][fmt] <= 1e-2, f"bf16 {fmt}: {results['bf16'][fmt]}"
    assert len(results["mlp"]) == 2 * len(FORMATS)


@pytest.mark.slow  # the Triton interpreter: > 2 s
def test_interpreted_kernels_match(interpreted):
    check(interpreted)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; test_interpreted_kernels_match is the CPU counterpart")
def test_cuda_kernels_match():
    from tests.kernels.triton.cases import run_all

    check(run_all("cuda"))


def test_auto_backend_is_torch_on_cpu():
    from kernels.grouped import triton_usable

    x = torch.zeros(1, 4)
    assert triton_usable(x) == (os.environ.get("TRITON_INTERPRET") == "1")
