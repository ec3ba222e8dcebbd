"""Dense x @ w.T at decode sizes: torch's best CPU layout against the compiled kernels, side by side.

  python bench/dense_linear.py [--threads 1] [--rows 1,4,16] [--dtype bfloat16,float32] [--repeat 40] [--fp8]

The matrices are the qwen3-sparse shape's attention projections (qkv 1536 x 1024, o 1024 x 1024, 32
copies of each cycled so that they come from memory as in a decode step) and its LM head (49152 x 1024,
a 64 MiB buffer written between calls to push it out of the caches). torch: the layout
`moemesh.models.layers.matmul_layout` chose before the compiled path (oneDNN-packed where packing
applies, else float32 [in, out] for MKL); compiled: `kernels.cpu.linear_cpu` on the plain [out, in]
matrix; with --fp8 also fp8: `kernels.cpu.linear_cpu` on the same matrix held in BlockwiseFP8 128x128
(`EngineConfig.dense_dtype="fp8"`), its ratio printed against both others. Fastest of --repeat calls
of each, interleaved; GB/s = the bytes that side reads / time.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

if __name__ == "__main__":  # as a script: the repository root instead of bench/ on sys.path
    _root = Path(__file__).resolve().parent.parent
    sys.path[:] = [str(_root)] + [p for p in sys.path if Path(p or ".").resolve() != _root / "bench"]

from kernels.cpu.linear_cpu import linear_cpu
from kernels.prepare import prepare_dense
from moemesh.models.layers import packed_for_linear

MATRICES = {"qkv": (1536, 1024, 32), "o": (1024, 1024, 32), "lm_head": (49152, 1024, 1)}  # N, K, copies


def torch_layout(w: torch.Tensor) -> torch.Tensor:
    packed = packed_for_linear(w)
    if packed is not None:
        return packed
    return w.t().contiguous().t() if w.dtype == torch.float32 else w


def torch_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return x @ w.t()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--dtype", default="bfloat16,float32")
    ap.add_argument("--repeat", type=int, default=40)
    ap.add_argument("--fp8", action="store_true", help="also the matrix in BlockwiseFP8 on the compiled kernels")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    flush = torch.empty(64 * 2**20, dtype=torch.uint8)
    print(f"threads={torch.get_num_threads()}")
    for dtype in (getattr(torch, d) for d in args.dtype.split(",")):
        for name, (n, k, copies) in MATRICES.items():
            plain = [(torch.randn(n, k) * 0.02).to(dtype) for _ in range(copies)]
            held = [torch_layout(w) for w in plain]
            fp8 = [prepare_dense(w, "fp8") for w in plain] if args.fp8 else []
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k).to(dtype)
                best = {"torch": float("inf"), "compiled": float("inf")} | ({"fp8": float("inf")} if fp8 else {})
                for rep in range(args.repeat):
                    i = rep % copies
                    sides = [("torch", lambda: torch_linear(x, held[i])), ("compiled", lambda: linear_cpu(x, plain[i]))]
                    if fp8:
                        sides.append(("fp8", lambda: linear_cpu(x, fp8[i])))
                    for side, fn in sides:
                        if copies == 1:
                            flush.add_(1)
                        start = time.perf_counter()
                        fn()
                        best[side] = min(best[side], time.perf_counter() - start)
                nbytes = {"torch": n * k * dtype.itemsize, "compiled": n * k * dtype.itemsize}
                if fp8:
                    nbytes["fp8"] = fp8[0].nbytes
                line = f"{str(dtype).removeprefix('torch.'):>9} {name:>8} M={m:<3}"
                for side, sec in best.items():
                    line += f"  {side} {sec * 1e3:7.3f} ms {nbytes[side] / sec / 1e9:5.1f} GB/s"
                line += f"  {best['torch'] / best['compiled']:.2f}x"
                if fp8:
                    line += f"  fp8 vs torch {best['torch'] / best['fp8']:.2f}x, vs compiled {best['compiled'] / best['fp8']:.2f}x"
                print(line, flush=True)


if __name__ == "__main__":
    main()
