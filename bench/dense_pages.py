"""Dense matrices in 4 KiB pages against 2 MiB pages: two engines in one process, decode steps alternated.

    python bench/dense_pages.py [--shape qwen3-sparse] [--model DIR] [--experts-dtype bf16|fp8|mxfp4|nvfp4]
        [--steps 300] [--threads 2] [--concurrent 1]

The checkpoint loader holds the dense matrices the compiled CPU kernels read plain (attention
projections, LM head) in 2 MiB transparent huge pages (`kernels.hugepages.huge_page_copy`, from
`moemesh.models.layers.matmul_layout`). This loads the same checkpoint twice, once as before
(4 KiB pages: huge pages turned off for that load only) and once as the loader does now, gives each
engine the same greedy requests, then times `engine.step()` on the two in turns (which goes first
alternates), so that both see the same machine; it prints each side's median and the ratio, and the
huge-page memory the process holds. Both engines hold their own experts (twice the checkpoint's
memory). Where the system has no transparent huge pages both sides are the same.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # as a script: the repository root instead of bench/ on sys.path
    _root = Path(__file__).resolve().parent.parent
    sys.path[:] = [str(_root)] + [p for p in sys.path if Path(p or ".").resolve() != _root / "bench"]

from bench import alternated_steps
from bench.alternated_steps import alternate, greedy_engine, model_dir


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return alternated_steps.parse_args(__doc__, argv)


def anon_huge_bytes() -> int:
    """Bytes of this process's anonymous memory in transparent huge pages (0 where not reported)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def load_engine(model: str, ns: argparse.Namespace, huge: bool):
    """An engine on `model` with its requests added and warmed up; huge=False loads its dense matrices
    into ordinary pages (huge pages turned off for this load)."""
    from kernels import hugepages

    madvise = hugepages._madvise
    try:
        if not huge:
            hugepages._madvise = lambda: None  # what the loader checks before each copy
        return greedy_engine(model, ns, ns.steps)
    finally:
        hugepages._madvise = madvise


def main(argv: list[str] | None = None) -> dict[str, float]:
    ns = parse_args(argv)
    model = model_dir(ns)
    torch.set_num_threads(ns.threads)
    before = anon_huge_bytes()
    small = load_engine(model, ns, huge=False)
    huge = load_engine(model, ns, huge=True)
    held = anon_huge_bytes() - before
    med = alternate(ns.steps, {"4 KiB": small.step, "2 MiB": huge.step})
    print(f"{model}: experts {ns.experts_dtype or 'as stored'}, {ns.concurrent} decoding, {ns.threads} thread(s), {ns.steps} steps each, alternated")
    print(f"dense matrices in 4 KiB pages: median {med['4 KiB']:.2f} ms/step; in 2 MiB pages: {med['2 MiB']:.2f} ms/step; "
          f"2 MiB / 4 KiB {med['2 MiB'] / med['4 KiB']:.3f}; huge-page memory held: {held / 2**20:.0f} MiB")
    return {"4k_ms": med["4 KiB"], "2m_ms": med["2 MiB"], "huge_bytes": float(held)}


if __name__ == "__main__":
    main()
