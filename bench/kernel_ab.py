"""The compiled CPU expert kernels of this checkout against those of another git revision, side by side
in one process: the same `moe_mlp` calls, interleaved call by call, on the same weights.

  python bench/kernel_ab.py [--rev main] [--tokens 1,4,16] [--dtype bfloat16,float32] [--repeat 100]
                            [--formats fp8,mxfp4,nvfp4] [--compute bfloat16]
                            [--threads 1] [--experts 64] [--top-k 8] [--hidden 1024] [--intermediate 384]
                            [--flush-mb 64]

--dtype names dense experts (weights and compute in that dtype); --formats names quantized experts
(kernels.prepare_experts), computed in --compute.

The other revision's kernels/cpu/csrc is written to a temporary directory and built there under its own
module name (about a minute), so both builds are loaded at once. Each batch of tokens routes each token
to --top-k of --experts experts, a fresh routing per call; the two builds take turns at going first
and read different routings in the same round, and --flush-mb MiB are read between calls so that no
call finds weights in the last-level cache (the weights come from memory, as in a decode step of a
model whose layers together exceed it); the figure is the fastest of --repeat calls (a shared machine slows some calls, never speeds any
up) and GB/s the stored bytes of the experts a call selects over that time.

Shape legend: E experts, H hidden, I intermediate, T tokens per call, G experts selected by a call.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

if __name__ == "__main__":  # as a script: the repository root instead of bench/ on sys.path
    _root = Path(__file__).resolve().parent.parent
    sys.path[:] = [str(_root)] + [p for p in sys.path if Path(p or ".").resolve() != _root / "bench"]

import kernels.cpu.moe_mlp_cpu as moe_mlp_cpu_module
from bench.kernel_formats import routing
from kernels import ExpertWeights, prepare_experts
from kernels.cpu.build import CFLAGS, CSRC, HEADERS, SOURCES, extension

ROUTINGS = 16


def build_revision(rev: str, where: Path):
    """The kernels as revision `rev` has them, built in `where` as module `moemesh_cpu_<hash>`."""
    from torch.utils import cpp_extension

    repo = CSRC.parent.parent.parent
    rel = CSRC.relative_to(repo).as_posix()
    for name in SOURCES + HEADERS:
        text = subprocess.run(["git", "-C", str(repo), "show", f"{rev}:{rel}/{name}"], check=True, capture_output=True).stdout
        (where / name).write_bytes(text)
    sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", rev], check=True, capture_output=True, text=True).stdout.strip()
    return cpp_extension.load(
        name=f"moemesh_cpu_{sha}", sources=[str(where / s) for s in SOURCES], extra_cflags=list(CFLAGS),
        build_directory=str(where), verbose=False,
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="main", help="the git revision to compare against")
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--dtype", default="bfloat16,float32", help="weight and compute dtypes, comma separated")
    ap.add_argument("--formats", default="", help="quantized expert formats, comma separated (fp8, mxfp4, nvfp4)")
    ap.add_argument("--compute", default="bfloat16", help="compute dtype of the quantized formats")
    ap.add_argument("--repeat", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=384)
    ap.add_argument("--flush-mb", type=int, default=64, help="MiB read between calls to evict the caches (0: none)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    here = extension()
    if here is None:
        raise SystemExit("the compiled CPU kernels are not available here")
    with tempfile.TemporaryDirectory(prefix="kernel_ab-") as tmp:
        builds = {args.rev: build_revision(args.rev, Path(tmp)), "this checkout": here}
        e, h, i, k = args.experts, args.hidden, args.intermediate, args.top_k
        flush = torch.ones(args.flush_mb << 20, dtype=torch.uint8) if args.flush_mb else None
        torch.manual_seed(0)
        dense = ExpertWeights(torch.randn(e, 2 * i, h) * 0.02, torch.randn(e, h, i) * 0.02)
        print(f"experts E={e} top-k={k} hidden H={h} intermediate I={i} threads={torch.get_num_threads()}")
        cases = []  # (label, weights, compute dtype)
        for dtype_name in filter(None, args.dtype.split(",")):
            dtype = getattr(torch, dtype_name)
            cases.append((dtype_name, ExpertWeights(dense.gate_up.to(dtype).contiguous(), dense.down.to(dtype).contiguous()), dtype))
        compute = getattr(torch, args.compute)
        for fmt in filter(None, args.formats.split(",")):
            cases.append((fmt, prepare_experts(dense, fmt, compute), compute))
        for label, w, dtype in cases:
            per_expert = w.nbytes / e
            for t in (int(v) for v in args.tokens.split(",")):
                calls = [routing(t, e, k, seed, "cpu") for seed in range(ROUTINGS)]
                x = torch.randn(t, h).to(dtype)
                best = dict.fromkeys(builds, float("inf"))
                outs = {}
                names = list(builds)
                for rep in range(args.repeat + ROUTINGS):  # the first ROUTINGS calls warm up
                    for turn in range(2):
                        bi = (rep + turn) % 2  # who goes first alternates
                        name, ext = names[bi], builds[names[bi]]
                        call = calls[(rep + bi * ROUTINGS // 2) % ROUTINGS]
                        if flush is not None:
                            flush.sum()
                        moe_mlp_cpu_module.extension = lambda ext=ext: ext
                        start = time.perf_counter()
                        outs[name] = moe_mlp_cpu_module.moe_mlp_cpu(x, *call, w)
                        if rep >= ROUTINGS:
                            best[name] = min(best[name], time.perf_counter() - start)
                for name, ext in builds.items():  # the same call on both builds
                    moe_mlp_cpu_module.extension = lambda ext=ext: ext
                    outs[name] = moe_mlp_cpu_module.moe_mlp_cpu(x, *calls[0], w)
                moe_mlp_cpu_module.extension = extension
                a, b = outs.values()
                if not torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-3):
                    raise SystemExit(f"T={t} {label}: the two builds disagree")
                g = min(len(c[2]) for c in calls)
                line = f"{label:>9} T={t:<3} G={g:<3}"
                for name, sec in best.items():
                    line += f"  {name}: {sec * 1e3:7.3f} ms {g * per_expert / sec / 1e9:5.1f} GB/s"
                print(f"{line}  {best[args.rev] / best['this checkout']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
