"""Decode attention over the paged KV cache, per call: this checkout's compiled kernel against another
git revision's build (and, with --torch, the torch path: paged_attention's SDPA), side by side in one
process, calls alternating.

  python bench/decode_attention.py [--rev main] [--contexts 64,512,2048] [--batch 1,16]
      [--dtype bfloat16] [--heads 16] [--kv-heads 4] [--head-dim 64] [--block-size 16]
      [--repeat 50] [--threads 2] [--torch]

Each case is B sequences of --contexts cached positions each, in shuffled blocks of a cache with room
for all of them (the qwen3-sparse attention shape by default: 16 query and 4 key/value heads of 64).
Every round calls each side once, the side going first rotating; printed are the median (and fastest)
milliseconds per call of each side and the ratio of the medians. This checkout's side runs through
kernels.cpu.step_ops (its Python checks included); the other revision's build is called directly. The
two sides' outputs are compared before timing.

Shape legend: B sequences, NH query heads, KVH key/value heads, D head dim, BS block size, NB blocks
per sequence, NBLK cache blocks, S = NB*BS positions.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

if __name__ == "__main__":  # as a script: the repository root instead of bench/ on sys.path
    _root = Path(__file__).resolve().parent.parent
    sys.path[:] = [str(_root)] + [p for p in sys.path if Path(p or ".").resolve() != _root / "bench"]

from bench.args import positive_ints
from bench.kernel_ab import build_revision
from kernels.cpu import step_ops
from kernels.cpu.build import extension
from kernels.cpu.variant import VARIANT_ENV, selected_variant
from moemesh.models.attention import paged_attention
from moemesh.models.batch import BatchMeta, SeqSlice


def decode_case(batch: int, context: int, nh: int, kvh: int, d: int, bs: int, dtype: torch.dtype, seed: int = 0):
    """(q [B, NH, D], k, v [B, KVH, D], k_cache, v_cache [NBLK, BS, KVH, D], meta): B sequences decoding
    their position `context - 1`, each over its own shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    nb = math.ceil(context / bs)
    blocks = torch.randperm(batch * nb, generator=g).view(batch, nb)  # [B, NB]
    meta = BatchMeta.build([SeqSlice([1], context - 1, blocks[i].tolist()) for i in range(batch)], bs)
    q = torch.randn(batch, nh, d, generator=g).to(dtype)
    k, v = (torch.randn(batch, kvh, d, generator=g).to(dtype) for _ in range(2))
    kc, vc = (torch.randn(batch * nb, bs, kvh, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v, kc, vc, meta


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="main", help="the git revision to compare against")
    ap.add_argument("--contexts", type=positive_ints, default=[64, 512, 2048])
    ap.add_argument("--batch", type=positive_ints, default=[1, 16])
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--torch", action="store_true", help="also time the torch path (SDPA)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if extension() is None or selected_variant() is None:
        raise SystemExit("the compiled CPU kernels are not available here")
    other = build_revision(args.rev).extension()
    dtype = getattr(torch, args.dtype)

    def here(q, k, v, kc, vc, meta):
        return step_ops.decode_attention(q, k, v, kc, vc, meta.slot_mapping, meta.decode_block_tables, meta.decode_mask)

    extra = (selected_variant(),) if "arg8" in (other.decode_attention.__doc__ or "") else ()  # a kernel that takes the variant

    def rev(q, k, v, kc, vc, meta):
        return other.decode_attention(q, k, v, kc, vc, meta.slot_mapping, meta.decode_block_tables, meta.decode_mask, *extra)

    def sdpa(q, k, v, kc, vc, meta):
        with mock.patch.dict(os.environ, {VARIANT_ENV: "torch"}):
            return paged_attention(q, k, v, meta, kc, vc)

    sides = {args.rev: rev, "this checkout": here}
    if args.torch:
        sides["torch"] = sdpa
    print(f"decode attention: NH={args.heads} KVH={args.kv_heads} D={args.head_dim} BS={args.block_size} {args.dtype}"
          f" threads={torch.get_num_threads()} variant={selected_variant()}; ms per call, median (fastest)")
    for b in args.batch:
        for s in args.contexts:
            case = decode_case(b, s, args.heads, args.kv_heads, args.head_dim, args.block_size, dtype)
            outs = {name: fn(*case) for name, fn in sides.items()}
            first = outs[args.rev].float()
            for name, out in outs.items():
                if not torch.allclose(out.float(), first, rtol=2e-2, atol=2e-2):
                    raise SystemExit(f"B={b} S={s}: {name} disagrees with {args.rev}")
            times = {name: [] for name in sides}
            names = list(sides)
            for rep in range(args.repeat + 3):  # the first 3 rounds warm up
                for turn in range(len(names)):
                    name = names[(rep + turn) % len(names)]
                    start = time.perf_counter()
                    sides[name](*case)
                    if rep >= 3:
                        times[name].append(time.perf_counter() - start)
            med = {name: statistics.median(t) for name, t in times.items()}
            line = f"B={b:<3} S={s:<5}"
            for name in names:
                line += f"  {name}: {med[name] * 1e3:7.3f} ({min(times[name]) * 1e3:7.3f})"
            line += f"  {args.rev} / this checkout: {med[args.rev] / med['this checkout']:.2f}x"
            print(line, flush=True)


if __name__ == "__main__":
    main()
