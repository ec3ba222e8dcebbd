"""Dense experts held [E, N, K] as loaded vs in the all-experts layout (`ConcatenatedExperts.adopt`:
bfloat16 down [H, E*I], float32 [in, out]), through `kernels.moe_mlp` at decode sizes, side by side.

  python bench/expert_layouts.py [--tokens 1,4,16] [--dtype bfloat16,float32] [--repeat 60] [--threads 1]

Same shape and routing as bench/kernel_formats.py (64 experts of 384, hidden 1024, top-8, a fresh
routing per call); the two layouts' calls are interleaved, fastest of --repeat each; GB/s = stored
bytes of the experts a call selects / time. A sparse model holds the first layout by default (the
all-experts path is only for top-k == E).

Shape legend: E experts, H hidden, I intermediate, T tokens per call, G experts selected by a call.
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

from bench.kernel_formats import routing
from kernels import ExpertWeights, moe_mlp
from moemesh.moe.concatenated_experts import ConcatenatedExperts

E, H, I, TOP_K, ROUTINGS = 64, 1024, 384, 8, 16


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--dtype", default="bfloat16,float32")
    ap.add_argument("--repeat", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"experts E={E} top-k={TOP_K} hidden H={H} intermediate I={I} threads={torch.get_num_threads()}")
    for dtype in (getattr(torch, d) for d in args.dtype.split(",")):
        w = ExpertWeights((torch.randn(E, 2 * I, H) * 0.02).to(dtype), (torch.randn(E, H, I) * 0.02).to(dtype))
        _, adopted = ConcatenatedExperts.adopt(w)
        layouts = {"as loaded": w, "all-experts layout": adopted}
        per_expert = w.nbytes / E
        for t in (int(v) for v in args.tokens.split(",")):
            calls = [routing(t, E, TOP_K, seed, "cpu") for seed in range(ROUTINGS)]
            x = torch.randn(t, H).to(dtype)
            best = dict.fromkeys(layouts, float("inf"))
            for rep in range(args.repeat + ROUTINGS):  # the first ROUTINGS calls warm up
                call = calls[rep % ROUTINGS]
                for name, held in layouts.items():
                    start = time.perf_counter()
                    moe_mlp(x, *call, held)
                    if rep >= ROUTINGS:
                        best[name] = min(best[name], time.perf_counter() - start)
            g = min(len(c[2]) for c in calls)
            line = f"{str(dtype).removeprefix('torch.'):>9} T={t:<3} G={g:<3}"
            for name, sec in best.items():
                line += f"  {name}: {sec * 1e3:7.3f} ms {g * per_expert / sec / 1e9:5.1f} GB/s"
            print(f"{line}  {best['all-experts layout'] / best['as loaded']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
