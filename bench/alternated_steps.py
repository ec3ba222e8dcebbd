"""Two ways of running the same decode steps, timed in turns in one process: what the side-by-side
step benches share (`bench/dense_pages.py`, `bench/decode_layer.py`).

`parse_args` gives a bench the checkpoint and load flags, `greedy_engine` an engine on it with greedy
requests added and warmed up, and `alternate` times each side's step in turns (which goes first
alternates), so that both sides see the same machine, and returns each side's median.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

from bench.shapes import SHAPES, checkpoint_dir

WARMUP_STEPS = 8


def parse_args(
    doc: str, argv: list[str] | None, steps: int = 300, extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """A bench's arguments (described by its docstring's first line), checked: --shape, --model,
    --experts-dtype, --steps, --threads, --concurrent, and those `extra` adds to the parser."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    if extra is not None:
        extra(p)
    p.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-sparse", help="named checkpoint (bench/shapes.py)")
    p.add_argument("--model", default=None, help="a checkpoint directory instead of --shape")
    p.add_argument("--experts-dtype", default=None, help="expert weight format (EngineConfig.experts_dtype); unset: as stored")
    p.add_argument("--steps", type=int, default=steps, help="timed decode steps of each side")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrent", type=int, default=1, help="greedy requests decoding together")
    ns = p.parse_args(argv)
    if ns.steps < 1 or ns.threads < 1 or ns.concurrent < 1:
        p.error(f"need --steps, --threads and --concurrent >= 1, got {ns.steps}, {ns.threads}, {ns.concurrent}")
    return ns


def model_dir(ns: argparse.Namespace) -> str:
    """--model, else --shape's checkpoint (built on first use)."""
    return ns.model or str(checkpoint_dir(ns.shape, progress=lambda msg: print(msg, file=sys.stderr)))


def greedy_engine(model: str, ns: argparse.Namespace, steps: int):
    """An engine on `model` (--experts-dtype, --threads) with --concurrent greedy requests long enough for
    `steps` decode steps after the warm-up, which has run."""
    from moemesh.engine import LLMEngine
    from moemesh.engine.config import EngineConfig

    engine = LLMEngine(EngineConfig(model_dir=model, experts_dtype=ns.experts_dtype, num_threads=ns.threads))
    greedy_requests(engine, ns, steps)
    return engine


def greedy_requests(engine, ns: argparse.Namespace, steps: int, tag: str = "r") -> None:
    """Lets the engine's requests finish, then gives it --concurrent new greedy requests (ids `tag`0,
    `tag`1, ...) long enough for `steps` decode steps after the warm-up, which has run."""
    from moemesh.engine.sampling_params import SamplingParams

    while engine.has_unfinished():
        engine.step()
    params = SamplingParams(max_new_tokens=WARMUP_STEPS + steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(ns.concurrent):
        engine.add_request(f"{tag}{i}", [1 + i, 20 + i, 300 + i, 4000 + i, 55, 66], params)
    for _ in range(WARMUP_STEPS):
        engine.step()


def alternate(steps: int, sides: dict[str, Callable[[], None]]) -> dict[str, float]:
    """Each side's step (two sides) timed `steps` times, in turns, the first alternating -> median ms per step."""
    a, b = sides
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(steps):
        for name in ((a, b) if i % 2 == 0 else (b, a)):
            t = time.perf_counter()
            sides[name]()
            times[name].append(time.perf_counter() - t)
    return {name: 1000 * statistics.median(v) for name, v in times.items()}
