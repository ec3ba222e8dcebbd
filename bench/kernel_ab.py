"""The compiled CPU expert kernels of this checkout against those of another git revision, side by side
in one process: the same `moe_mlp` calls, interleaved call by call, on the same weights (each side's
own `kernels/cpu/moe_mlp_cpu.py` calling its build, so the per-call Python work is measured too).

  python bench/kernel_ab.py [--rev main] [--tokens 1,4,16] [--dtype bfloat16,float32] [--repeat 100]
                            [--formats fp8,mxfp4,nvfp4] [--compute bfloat16]
                            [--threads 1] [--experts 64] [--top-k 8] [--hidden 1024] [--intermediate 384]
                            [--flush-mb 64] [--pages 4k|huge|both]

--dtype names dense experts (weights and compute in that dtype); --formats names quantized experts
(kernels.prepare_experts), computed in --compute.

The other revision's kernels/cpu/csrc is written to a directory of the kernel cache and built there under
its own module name (about a minute, once per commit), so both builds are loaded at once. Each batch of tokens routes each token
to --top-k of --experts experts, a fresh routing per call; the two builds take turns at going first
and read different routings in the same round, and --flush-mb MiB are read between calls so that no
call finds weights in the last-level cache (the weights come from memory, as in a decode step of a
model whose layers together exceed it); the figure is the fastest of --repeat calls (a shared machine slows some calls, never speeds any
up) and GB/s the stored bytes of the experts a call selects over that time; the medians of both sides
follow. The weights are held in 4 KiB pages, as the checkpoint loader holds them (`--pages 4k`), or
moved into 2 MiB huge pages with the flush buffer (`--pages huge`, kernels.hugepages); `--pages both`
compares the two memories on this checkout's build instead of two builds.

Shape legend: E experts, H hidden, I intermediate, T tokens per call, G experts selected by a call.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

if __name__ == "__main__":  # as a script: the repository root instead of bench/ on sys.path
    _root = Path(__file__).resolve().parent.parent
    sys.path[:] = [str(_root)] + [p for p in sys.path if Path(p or ".").resolve() != _root / "bench"]

import kernels.cpu.moe_mlp_cpu as moe_mlp_cpu_module
from bench.kernel_formats import routing
from kernels import ExpertWeights, prepare_experts
from kernels.hugepages import experts_in_huge_pages, to_huge_pages
from kernels.cpu.build import CFLAGS, CSRC, SOURCES, cache_root, extension

ROUTINGS = 16


def copy_experts(w: ExpertWeights) -> ExpertWeights:
    """w with every tensor of its projections copied into fresh memory."""
    def fresh(t):
        if isinstance(t, torch.Tensor):
            return t.clone()
        return dataclasses.replace(t, **{f.name: fresh(getattr(t, f.name)) for f in dataclasses.fields(t)
                                         if isinstance(getattr(t, f.name), torch.Tensor)})
    return dataclasses.replace(w, gate_up=fresh(w.gate_up), down=fresh(w.down))


def build_revision(rev: str):
    """The kernels as revision `rev` has them, built as module `moemesh_cpu_<hash>` in a directory of
    the kernel cache kept per commit (a later run against the same commit builds nothing), with the
    revision's `kernels/cpu/moe_mlp_cpu.py` calling them: that module."""
    from torch.utils import cpp_extension

    repo = CSRC.parent.parent.parent
    rel = CSRC.relative_to(repo).as_posix()
    sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", rev], check=True, capture_output=True, text=True).stdout.strip()
    where = cache_root() / f"kernel_ab-{sha}"
    where.mkdir(parents=True, exist_ok=True)
    # every file of the revision's csrc (its headers may differ from this checkout's), and the sources
    # of this checkout's list that it has
    listed = subprocess.run(["git", "-C", str(repo), "ls-tree", "--name-only", f"{rev}:{rel}"], check=True, capture_output=True,
                            text=True).stdout.split()
    for name in listed:
        text = subprocess.run(["git", "-C", str(repo), "show", f"{rev}:{rel}/{name}"], check=True, capture_output=True).stdout
        if not (where / name).exists() or (where / name).read_bytes() != text:  # unchanged sources: ninja has nothing to do
            (where / name).write_bytes(text)
    ext = cpp_extension.load(
        name=f"moemesh_cpu_{sha}", sources=[str(where / s) for s in SOURCES if s in listed], extra_cflags=list(CFLAGS),
        build_directory=str(where), verbose=False,
    )
    # the revision's Python side of the call too (what a step pays per call), on its own build
    wrapper = subprocess.run(["git", "-C", str(repo), "show", f"{rev}:kernels/cpu/moe_mlp_cpu.py"], check=True, capture_output=True).stdout
    (where / "moe_mlp_cpu_rev.py").write_bytes(wrapper)
    spec = importlib.util.spec_from_file_location(f"moe_mlp_cpu_{sha}", where / "moe_mlp_cpu_rev.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.extension = lambda: ext
    return module


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
    ap.add_argument(
        "--pages", choices=("4k", "huge", "both"), default="4k",
        help="the weights' memory: 4 KiB pages (as the checkpoint loader holds experts), huge pages where "
        "the kernel grants them, or both: this checkout's build on each, side by side (no --rev build)",
    )
    ap.add_argument("--flush-mb", type=int, default=64, help="MiB read between calls to evict the caches (0: none)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    here = extension()
    if here is None:
        raise SystemExit("the compiled CPU kernels are not available here")
    if args.pages == "both":  # one build, the weights in 4 KiB pages against a copy in huge pages
        builds = {"4 KiB pages": moe_mlp_cpu_module, "huge pages": moe_mlp_cpu_module}
    else:
        builds = {args.rev: build_revision(args.rev), "this checkout": moe_mlp_cpu_module}
    e, h, i, k = args.experts, args.hidden, args.intermediate, args.top_k
    flush = torch.ones(args.flush_mb << 20, dtype=torch.uint8) if args.flush_mb else None
    if flush is not None and args.pages != "4k":  # the flush evicts caches, not the weights' TLB entries
        to_huge_pages(flush)
    torch.manual_seed(0)
    dense = ExpertWeights(torch.randn(e, 2 * i, h) * 0.02, torch.randn(e, h, i) * 0.02)
    print(f"experts E={e} top-k={k} hidden H={h} intermediate I={i} threads={torch.get_num_threads()} pages={args.pages}")
    cases = []  # (label, weights, compute dtype)
    for dtype_name in filter(None, args.dtype.split(",")):
        dtype = getattr(torch, dtype_name)
        cases.append((dtype_name, ExpertWeights(dense.gate_up.to(dtype).contiguous(), dense.down.to(dtype).contiguous()), dtype))
    compute = getattr(torch, args.compute)
    for fmt in filter(None, args.formats.split(",")):
        cases.append((fmt, prepare_experts(dense, fmt, compute), compute))
    for label, w, dtype in cases:
        per_expert = w.nbytes / e
        if args.pages == "both":
            weights = dict(zip(builds, (w, experts_in_huge_pages(copy_experts(w)))))
        else:
            weights = dict.fromkeys(builds, experts_in_huge_pages(w) if args.pages == "huge" else w)
        for t in (int(v) for v in args.tokens.split(",")):
            calls = [routing(t, e, k, seed, "cpu") for seed in range(ROUTINGS)]
            x = torch.randn(t, h).to(dtype)
            times = {name: [] for name in builds}
            outs = {}
            names = list(builds)
            for rep in range(args.repeat + ROUTINGS):  # the first ROUTINGS calls warm up
                for turn in range(2):
                    bi = (rep + turn) % 2  # who goes first alternates
                    name, side = names[bi], builds[names[bi]]
                    call = calls[(rep + bi * ROUTINGS // 2) % ROUTINGS]
                    if flush is not None:
                        flush.sum()
                    start = time.perf_counter()
                    outs[name] = side.moe_mlp_cpu(x, *call, weights[name])
                    if rep >= ROUTINGS:
                        times[name].append(time.perf_counter() - start)
            for name, side in builds.items():  # the same call on both sides
                outs[name] = side.moe_mlp_cpu(x, *calls[0], weights[name])
            a, b = outs.values()
            if not torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-3):
                raise SystemExit(f"T={t} {label}: the two sides disagree")
            g = min(len(c[2]) for c in calls)
            line = f"{label:>9} T={t:<3} G={g:<3}"
            best = {name: min(v) for name, v in times.items()}
            median = {name: statistics.median(v) for name, v in times.items()}
            for name, sec in best.items():
                line += f"  {name}: {sec * 1e3:7.3f} ms {g * per_expert / sec / 1e9:5.1f} GB/s"
            first, second = names
            line += f"  {best[first] / best[second]:.2f}x"
            line += f"  (medians {median[first] * 1e3:.3f} / {median[second] * 1e3:.3f} ms,"
            line += f" {median[first] / median[second]:.2f}x)"
            print(line, flush=True)


if __name__ == "__main__":
    main()
