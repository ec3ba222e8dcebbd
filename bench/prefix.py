"""Prefix caching and chunked prefill through the mesh (control, 1 expert server, 1 attention replica,
router; the demo model by default), measured in one run, side by side:

(a) agent-like workload: one shared system prompt of --system-len tokens (1500) and --num-requests
    (32) requests, each the system prompt plus its own user turn (--turn-len tokens), --concurrency (4)
    at a time, greedy, --output-len tokens each; once on a mesh whose attention replica caches
    prefixes and once on one started with --no-prefix-cache. Reports the time to first token (p50,
    p90) of each and the ratio of the p50s, cached / uncached (target <= 0.25x), and the cached
    tokens the replicas reported (0 on the uncached mesh, checked).
(b) chunked prefill, on the caching mesh: one stream decoding (--decode-len tokens after a short
    prompt) while a --long-len (2000) token prompt arrives (after the stream's first --lead-tokens
    tokens). Reports the decoding stream's largest gap between two tokens vs its median gap (target
    <= 6x), and the long prompt's time to first token vs the same length of prompt on the idle mesh
    (target <= 2x). Prompts are random token ids, distinct per request: nothing in (b) hits the cache.

Both meshes run with --max-num-batched-tokens (the attention step's token budget: decodes first, then
prompt chunks); a smaller budget shortens the gaps a long prompt's chunks leave in other streams and
adds steps to its prefill. Each mesh first gets --warmup-requests untimed short requests.

`--part agent` or `--part chunked` runs only (a) (both meshes) or only (b) (the caching mesh).

    python bench/prefix.py [--max-num-batched-tokens 32] [--part all|agent|chunked] [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

TARGET_TTFT_RATIO = 0.25
TARGET_GAP_RATIO = 6.0
TARGET_LONG_TTFT_RATIO = 2.0


@dataclass
class Stream:
    """One request's timeline: when it was sent, when each response with tokens arrived, its usage."""

    sent: float
    arrivals: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    prompt_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


async def stream(stub, prompt: list[int], max_new_tokens: int, on_token=None) -> Stream:
    """Sends one greedy request and records its timeline; `on_token(n)` after each response with tokens."""
    from moemesh.rpc.generation import build_request

    req = build_request(prompt_token_ids=prompt, max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    s = Stream(time.perf_counter())
    async for resp in stub.Generate(req, wait_for_ready=True, timeout=3600):
        if resp.token_ids:
            s.arrivals.append(time.perf_counter())
            if on_token is not None:
                on_token(len(s.arrivals))
        if resp.finish_reason:
            s.cached_tokens, s.prompt_tokens = resp.usage.cached_tokens, resp.usage.prompt_tokens
    return s


async def with_stub(router: str, body):
    import grpc

    from moemesh.rpc.config import RpcConfig
    from moemesh.rpc.generation import pb_grpc

    async with grpc.aio.insecure_channel(router, options=RpcConfig().channel_options()) as channel:
        return await body(pb_grpc.GenerationStub(channel))


async def warmup(stub, prompts: list[list[int]]) -> None:
    await asyncio.gather(*(stream(stub, p, 2) for p in prompts))


async def agent(stub, system: list[int], turns: list[list[int]], concurrency: int, output_len: int) -> list[Stream]:
    """(a): system + each turn, `concurrency` requests in flight at a time; results in turn order."""
    queue = list(range(len(turns)))[::-1]
    out: list[Stream | None] = [None] * len(turns)

    async def worker() -> None:
        while queue:
            i = queue.pop()
            out[i] = await stream(stub, system + turns[i], output_len)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


async def long_during_decode(stub, decode_prompt: list[int], decode_len: int, lead: int, long_prompt: list[int]) -> tuple[Stream, Stream]:
    """(b): the decoding stream, and the long prompt sent once that stream has `lead` tokens."""
    started = asyncio.Event()
    decoding = asyncio.create_task(stream(stub, decode_prompt, decode_len, lambda n: n >= lead and started.set()))
    await started.wait()
    long = await stream(stub, long_prompt, 1)
    return await decoding, long


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the demo model, built if absent)")
    p.add_argument("--max-num-batched-tokens", type=int, default=32, help="the attention replica's token budget per step")
    p.add_argument("--system-len", type=int, default=1500)
    p.add_argument("--turn-len", type=int, default=48)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--long-len", type=int, default=2000)
    p.add_argument("--decode-len", type=int, default=400, help="tokens of the decoding stream in (b): it must outlast the long prompt's prefill")
    p.add_argument("--lead-tokens", type=int, default=20, help="tokens the decoding stream has before the long prompt is sent")
    p.add_argument("--warmup-requests", type=int, default=4)
    p.add_argument("--vocab-low", type=int, default=1000, help="random prompt ids are drawn from [vocab-low, vocab-high)")
    p.add_argument("--vocab-high", type=int, default=20000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--part", choices=("all", "agent", "chunked"), default="all",
                   help="run both parts, only (a) the agent-like workload, or only (b) the long prompt during a decode")
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    for name in ("max_num_batched_tokens", "system_len", "turn_len", "num_requests", "concurrency", "output_len",
                 "long_len", "decode_len", "lead_tokens"):
        if getattr(ns, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if ns.decode_len <= ns.lead_tokens + 1:
        p.error("--decode-len must exceed --lead-tokens + 1")

    from moemesh.launcher.mesh import Mesh, MeshSpec

    model = ns.model
    if model is None:
        from moemesh.demo_model import ensure_demo_model

        model = str(ensure_demo_model())
    rng = random.Random(ns.seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(ns.vocab_low, ns.vocab_high) for _ in range(n)]

    system, turns = draw(ns.system_len), [draw(ns.turn_len) for _ in range(ns.num_requests)]
    warm = [draw(16) for _ in range(ns.warmup_requests)]
    decode_prompt, long_idle, long_busy = draw(32), draw(ns.long_len), draw(ns.long_len)

    runs: dict[str, list[Stream]] = {}
    chunked: dict[str, Stream] = {}
    agent_part, chunked_part = ns.part in ("all", "agent"), ns.part in ("all", "chunked")
    for cache in (False, True) if agent_part else (True,):
        spec = MeshSpec(model_dir=model, expert_servers=1, prefix_cache=cache, max_num_batched_tokens=ns.max_num_batched_tokens)
        mesh = Mesh(spec)
        try:
            router, _ = mesh.start()

            async def measure(stub):
                if warm:
                    await warmup(stub, warm)
                if agent_part:
                    runs["cached" if cache else "uncached"] = await agent(stub, system, turns, ns.concurrency, ns.output_len)
                if cache and chunked_part:
                    chunked["idle"] = await stream(stub, long_idle, 1)
                    chunked["decoding"], chunked["long"] = await long_during_decode(
                        stub, decode_prompt, ns.decode_len, ns.lead_tokens, long_busy)

            asyncio.run(with_stub(router, measure))
        finally:
            mesh.stop()

    summary: dict = {"max_num_batched_tokens": ns.max_num_batched_tokens}
    if agent_part:
        if any(s.cached_tokens for s in runs["uncached"]):
            print("prefix: the uncached mesh reported cached tokens: its attention replica ignored --no-prefix-cache", file=sys.stderr)
            return 1
        ttft = {name: [s.ttft for s in streams] for name, streams in runs.items()}
        summary.update({
            "agent": {
                name: {"ttft_p50_ms": round(1000 * percentile(v, 50), 1), "ttft_p90_ms": round(1000 * percentile(v, 90), 1),
                       "cached_tokens_p50": percentile([s.cached_tokens for s in runs[name]], 50)}
                for name, v in ttft.items()
            },
            "ttft_p50_ratio": round(percentile(ttft["cached"], 50) / percentile(ttft["uncached"], 50), 3),
            "target_ttft_ratio": TARGET_TTFT_RATIO,
        })
    if chunked_part:
        decoding, long, idle = chunked["decoding"], chunked["long"], chunked["idle"]
        if decoding.arrivals[-1] < long.arrivals[0]:
            print("prefix: the decoding stream ended before the long prompt's first token: raise --decode-len", file=sys.stderr)
            return 1
        gaps = decoding.gaps
        # the decoding stream's largest gaps, each with when it ended relative to the long prompt's send
        worst = sorted(range(len(gaps)), key=gaps.__getitem__)[-5:][::-1]
        # the gaps that end while the long prompt prefills: each one a step with a prompt chunk
        during = [g for g, end in zip(gaps, decoding.arrivals[1:]) if long.sent < end <= long.arrivals[0]]
        summary.update({
            "decode_gap_median_ms": round(1000 * statistics.median(gaps), 1),
            "decode_gap_max_ms": round(1000 * max(gaps), 1),
            "gap_ratio": round(max(gaps) / statistics.median(gaps), 2),
            "target_gap_ratio": TARGET_GAP_RATIO,
            "decode_gap_during_prefill_median_ms": round(1000 * statistics.median(during), 1) if during else None,
            "decode_gaps_worst": [
                {"ms": round(1000 * gaps[i], 1), "ends_after_long_sent_ms": round(1000 * (decoding.arrivals[i + 1] - long.sent), 1)}
                for i in worst
            ],
            "long_ttft_idle_ms": round(1000 * idle.ttft, 1),
            "long_ttft_during_decode_ms": round(1000 * long.ttft, 1),
            "long_ttft_ratio": round(long.ttft / idle.ttft, 2),
            "target_long_ttft_ratio": TARGET_LONG_TTFT_RATIO,
        })
    if ns.json:
        print(json.dumps(summary))
        return 0
    print(f"budget: {ns.max_num_batched_tokens} tokens per step")
    if agent_part:
        print(f"(a) {ns.num_requests} requests, {ns.system_len}-token shared system prompt + {ns.turn_len}-token turns, "
              f"{ns.concurrency} at a time, {ns.output_len} output tokens:")
        for name, a in summary["agent"].items():
            print(f"  {name:>9}: TTFT p50 {a['ttft_p50_ms']:9.1f} ms  p90 {a['ttft_p90_ms']:9.1f} ms  cached tokens p50 {a['cached_tokens_p50']}")
        print(f"  TTFT p50 cached / uncached: {summary['ttft_p50_ratio']:.3f}x (target <= {TARGET_TTFT_RATIO}x)")
    if chunked_part:
        print(f"(b) a {ns.long_len}-token prompt arriving while a stream decodes:")
        print(f"  decoding stream: median gap {summary['decode_gap_median_ms']} ms, worst {summary['decode_gap_max_ms']} ms: "
              f"{summary['gap_ratio']}x (target <= {TARGET_GAP_RATIO}x)")
        if during:
            print(f"  median gap while the long prompt prefills: {summary['decode_gap_during_prefill_median_ms']} ms ({len(during)} gaps)")
        print("  its worst gaps (ms, ending at ms after the long prompt was sent): "
              + ", ".join(f"{g['ms']} @ {g['ends_after_long_sent_ms']}" for g in summary["decode_gaps_worst"]))
        print(f"  long prompt TTFT: {summary['long_ttft_during_decode_ms']} ms vs {summary['long_ttft_idle_ms']} ms on the idle mesh: "
              f"{summary['long_ttft_ratio']}x (target <= {TARGET_LONG_TTFT_RATIO}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
