"""Decode rates: tokens per wall-clock second and per CPU-second of the measuring process.

Per CPU-second is what the code would reach on an idle core when the machine is oversubscribed
(with more than one thread it also counts spin-waits). Rates are taken from the first generated
token to the last, so the prefill is excluded.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class Rate:
    """Decode tokens per wall-clock second and per CPU-second, and the mean wall seconds per step."""

    wall: float
    cpu: float
    step_s: float


def now() -> tuple[float, float]:
    """(wall, process CPU) seconds."""
    return time.perf_counter(), time.process_time()


def rate(tokens: int, steps: int, start: tuple[float, float], end: tuple[float, float]) -> Rate:
    wall, cpu = end[0] - start[0], end[1] - start[1]
    return Rate(tokens / max(wall, 1e-9), tokens / max(cpu, 1e-9), wall / max(steps, 1))


def best(rates: Iterable[Rate]) -> Rate:
    """The best of repeated runs on each measure (a noisy neighbour only ever slows a run down)."""
    rs = list(rates)
    return Rate(max(r.wall for r in rs), max(r.cpu for r in rs), min(r.step_s for r in rs))


def engine_decode_rate(engine, batch: Sequence[Sequence[int]], new_tokens: int) -> Rate:
    """Greedy decode of `new_tokens` for each prompt of `batch` at once through an `LLMEngine`,
    timed from the step after the prefill (which yields the first token) to the last."""
    from moemesh.engine import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add_request(f"bench-{i}", list(p), params)
    engine.step()  # prefill + first token
    steps, tokens = 0, 0
    start = now()
    while engine.has_unfinished():
        tokens += len(engine.step())
        steps += 1
    return rate(tokens, steps, start, now())
