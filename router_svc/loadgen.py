"""Load generation for `moemesh bench`: one workload, driven over gRPC or through an in-process
engine, measured the same way.

Per request: TTFT (submit -> first token) and TPOT (mean time per output token after the first).
Arrivals: `concurrency` closed-loop streams, or Poisson arrivals at `rate` requests/s.
"""
from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from dataclasses import dataclass, field


MAX_COUNT = 1 << 20  # requests, streams and tokens per request: more than any mesh serves in one run


@dataclass(frozen=True)
class Workload:
    num_requests: int = 32
    concurrency: int = 16
    rate: float = 0.0  # requests/s, Poisson; 0 = closed loop with `concurrency` streams
    prompt_len: int = 32
    output_len: int = 32
    vocab_low: int = 16  # random prompt ids from [vocab_low, vocab_high): no special tokens
    vocab_high: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "concurrency", "prompt_len", "output_len"):
            if not 1 <= getattr(self, name) <= MAX_COUNT:
                raise ValueError(f"{name} must be in [1, {MAX_COUNT}], got {getattr(self, name)}")
        if not (math.isfinite(self.rate) and self.rate >= 0):
            raise ValueError(f"rate must be a finite number >= 0, got {self.rate}")
        if not 0 <= self.vocab_low < self.vocab_high:
            raise ValueError(f"need 0 <= vocab_low < vocab_high, got {self.vocab_low}, {self.vocab_high}")

    def prompts(self) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [[rng.randrange(self.vocab_low, self.vocab_high) for _ in range(self.prompt_len)] for _ in range(self.num_requests)]

    def arrivals(self) -> list[float]:
        """Offsets (s) at which each request is submitted; all 0 in closed-loop mode."""
        if self.rate <= 0:
            return [0.0] * self.num_requests
        rng = random.Random(self.seed + 1)
        t, out = 0.0, []
        for _ in range(self.num_requests):
            out.append(t)
            t += rng.expovariate(self.rate)
        return out


@dataclass
class RequestTiming:
    submitted: float
    first: float = 0.0
    done: float = 0.0
    tokens: int = 0
    token_ids: list[int] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.first - self.submitted

    @property
    def tpot(self) -> float | None:
        return (self.done - self.first) / (self.tokens - 1) if self.tokens > 1 else None


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


@dataclass
class BenchResult:
    name: str
    wall_s: float
    timings: list[RequestTiming]

    @property
    def output_tokens(self) -> int:
        return sum(t.tokens for t in self.timings)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict:
        ttft = [t.ttft for t in self.timings]
        tpot = [t.tpot for t in self.timings if t.tpot is not None]
        return {
            "name": self.name,
            "requests": len(self.timings),
            "output_tokens": self.output_tokens,
            "wall_s": round(self.wall_s, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "ttft_p50_ms": round(1000 * percentile(ttft, 50), 2),
            "ttft_p99_ms": round(1000 * percentile(ttft, 99), 2),
            "tpot_p50_ms": round(1000 * percentile(tpot, 50), 2),
            "tpot_p99_ms": round(1000 * percentile(tpot, 99), 2),
            "ttft_mean_ms": round(1000 * statistics.fmean(ttft), 2) if ttft else None,
        }


async def _scheduled(work: Workload, run_one) -> float:
    """Runs `run_one(i)` for every request per the workload's arrivals; returns the wall time."""
    start = time.perf_counter()
    if work.rate > 0:
        async def at(i: int, offset: float) -> None:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            await run_one(i)

        await asyncio.gather(*(at(i, off) for i, off in enumerate(work.arrivals())))
    else:
        queue = list(range(work.num_requests))[::-1]

        async def worker() -> None:
            while queue:
                await run_one(queue.pop())

        await asyncio.gather(*(worker() for _ in range(min(work.concurrency, work.num_requests))))
    return time.perf_counter() - start


async def run_grpc(address: str, work: Workload, name: str = "mesh", api_key: str = "", first_at_text: bool = False) -> BenchResult:
    """The workload against a router over gRPC (greedy, ignore_eos, exactly output_len tokens each).
    TTFT ends at the first message carrying tokens, or with `first_at_text` at the first carrying text
    (as a client showing text sees it: a token held back as an incomplete character counts later)."""
    from moemesh.rpc.config import RpcConfig
    from moemesh.rpc.server import make_channel
    from moemesh.rpc.generation import build_request, pb_grpc

    prompts = work.prompts()
    timings: list[RequestTiming | None] = [None] * work.num_requests
    async with make_channel(address, RpcConfig(), api_key=api_key) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def one(i: int) -> None:
            req = build_request(prompt_token_ids=prompts[i], max_new_tokens=work.output_len, temperature=0.0, ignore_eos=True)
            t = RequestTiming(time.perf_counter())
            async for resp in stub.Generate(req, wait_for_ready=True):
                if not t.first and (resp.text if first_at_text else resp.token_ids):
                    t.first = time.perf_counter()
                t.tokens += len(resp.token_ids)
                t.token_ids.extend(resp.token_ids)
            t.done = time.perf_counter()
            t.first = t.first or t.done  # no text at all (first_at_text): the stream's end
            timings[i] = t

        wall = await _scheduled(work, one)
    return BenchResult(name, wall, timings)


def run_engine(engine, work: Workload, name: str = "in-process") -> BenchResult:
    """The same workload through an in-process `LLMEngine`: arrivals fed between steps."""
    from moemesh.engine import SamplingParams

    params = SamplingParams(max_new_tokens=work.output_len, temperature=0.0, ignore_eos=True)
    prompts = work.prompts()
    arrivals = work.arrivals()
    timings: dict[str, RequestTiming] = {}
    next_i, live = 0, 0
    start = time.perf_counter()
    while next_i < work.num_requests or engine.has_unfinished():
        now = time.perf_counter()
        while next_i < work.num_requests and (
            (work.rate > 0 and start + arrivals[next_i] <= now) or (work.rate <= 0 and live < work.concurrency)
        ):
            rid = f"bench-{next_i}"
            timings[rid] = RequestTiming(now)
            engine.add_request(rid, prompts[next_i], params)
            next_i, live = next_i + 1, live + 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(0.01, start + arrivals[next_i] - time.perf_counter())))
            continue
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            t = timings[out.request_id]
            if out.token_id is not None:
                if not t.tokens:
                    t.first = now
                t.tokens += 1
                t.token_ids.append(out.token_id)
            if out.finished:
                t.done = now
                live -= 1
    wall = time.perf_counter() - start
    return BenchResult(name, wall, [timings[f"bench-{i}"] for i in range(work.num_requests)])


def plot(results: list[BenchResult], path: str) -> None:
    """TTFT and TPOT distributions (CDFs) of each run, side by side, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for r in results:
        for ax, values in ((axes[0], [t.ttft for t in r.timings]), (axes[1], [t.tpot for t in r.timings if t.tpot is not None])):
            xs = sorted(1000 * v for v in values)
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r.name)
    axes[2].bar([r.name for r in results], [r.tokens_per_s for r in results])
    for ax, title in zip(axes, ("TTFT (ms) CDF", "time per output token (ms) CDF", "output tokens/s")):
        ax.set_title(title)
    axes[0].legend()
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
