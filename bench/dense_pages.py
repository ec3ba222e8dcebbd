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
import statistics
import sys
import time
from pathlib import Path

import torch

if __name__ == "__main__":  # as a script: the repository root instead of bench/ on sys.path
    _root = Path(__file__).resolve().parent.parent
    sys.path[:] = [str(_root)] + [p for p in sys.path if Path(p or ".").resolve() != _root / "bench"]

from bench.shapes import SHAPES, checkpoint_dir

WARMUP_STEPS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-sparse", help="named checkpoint (bench/shapes.py)")
    p.add_argument("--model", default=None, help="a checkpoint directory instead of --shape")
    p.add_argument("--experts-dtype", default=None, help="expert weight format (EngineConfig.experts_dtype); unset: as stored")
    p.add_argument("--steps", type=int, default=300, help="timed decode steps of each engine")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrent", type=int, default=1, help="greedy requests decoding together")
    ns = p.parse_args(argv)
    if ns.steps < 1 or ns.threads < 1 or ns.concurrent < 1:
        p.error(f"need --steps, --threads and --concurrent >= 1, got {ns.steps}, {ns.threads}, {ns.concurrent}")
    return ns


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
    from moemesh.engine import LLMEngine
    from moemesh.engine.config import EngineConfig
    from moemesh.engine.sampling_params import SamplingParams

    madvise = hugepages._madvise
    try:
        if not huge:
            hugepages._madvise = lambda: None  # what the loader checks before each copy
        engine = LLMEngine(EngineConfig(model_dir=model, experts_dtype=ns.experts_dtype, num_threads=ns.threads))
    finally:
        hugepages._madvise = madvise
    params = SamplingParams(max_new_tokens=WARMUP_STEPS + ns.steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(ns.concurrent):
        engine.add_request(f"r{i}", [1 + i, 20 + i, 300 + i, 4000 + i, 55, 66], params)
    for _ in range(WARMUP_STEPS):
        engine.step()
    return engine


def main(argv: list[str] | None = None) -> dict[str, float]:
    ns = parse_args(argv)
    model = ns.model or str(checkpoint_dir(ns.shape, progress=lambda msg: print(msg, file=sys.stderr)))
    torch.set_num_threads(ns.threads)
    before = anon_huge_bytes()
    small = load_engine(model, ns, huge=False)
    huge = load_engine(model, ns, huge=True)
    held = anon_huge_bytes() - before
    times: dict[str, list[float]] = {"4 KiB": [], "2 MiB": []}
    for i in range(ns.steps):
        for name in (("4 KiB", "2 MiB") if i % 2 == 0 else ("2 MiB", "4 KiB")):
            engine = small if name == "4 KiB" else huge
            t = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - t)
    med = {name: 1000 * statistics.median(v) for name, v in times.items()}
    print(f"{model}: experts {ns.experts_dtype or 'as stored'}, {ns.concurrent} decoding, {ns.threads} thread(s), {ns.steps} steps each, alternated")
    print(f"dense matrices in 4 KiB pages: median {med['4 KiB']:.2f} ms/step; in 2 MiB pages: {med['2 MiB']:.2f} ms/step; "
          f"2 MiB / 4 KiB {med['2 MiB'] / med['4 KiB']:.3f}; huge-page memory held: {held / 2**20:.0f} MiB")
    return {"4k_ms": med["4 KiB"], "2m_ms": med["2 MiB"], "huge_bytes": float(held)}


if __name__ == "__main__":
    main()
