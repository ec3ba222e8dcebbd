"""Decode tokens/s of the moemesh engine vs transformers `generate`, same checkpoint and dtype.

Prints, side by side from one run, per dtype: batch 1, and N concurrent requests (vs transformers
batched generate on the same prompts), plus the batch-1 weight traffic in GB/s next to a measured
copy bandwidth (the memory-bandwidth limit of a decode step).

  python bench/engine_vs_transformers.py [--model DIR] [--dtypes float32,bfloat16] [--new-tokens 32]

Without --model it uses the demo model when it has been built (`moemesh demo-model`), else a random
checkpoint of the demo model's shape (SmolLM2-135M as an 8-expert Mixtral: hidden 576, 30 layers,
9/3 heads, experts of 192, vocab 49152, tied embeddings). Decode rates exclude the prefill: both
sides are timed from their first generated token to their last. Each figure is the best of --repeats
interleaved runs, so a noisy neighbour on a shared machine hurts both sides alike. Next to wall-clock
rates it prints tokens per CPU-second of this process: on an oversubscribed machine with --threads 1
that is the rate the code would reach on an idle core (with more threads it also counts spin-waits).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# Run as a script, bench/ is first on sys.path: drop it so no bench script can shadow a package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

DEMO_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=192,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    num_local_experts=8,
    num_experts_per_tok=8,
    router_jitter_noise=0.0,
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class BenchConfig:
    model: str | None
    dtypes: tuple[str, ...]
    new_tokens: int
    prompt_len: int
    concurrent: int
    threads: int
    repeats: int
    pack_experts: bool | None


def build_random_demo_shape(out: Path) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    model = tf.MixtralForCausalLM(tf.MixtralConfig(**DEMO_SHAPE)).eval()
    model.save_pretrained(out)
    return out


def default_model_dir(tmp: Path) -> Path:
    from moemesh.demo_model.locate import default_demo_dir

    demo = default_demo_dir()
    if (demo / "config.json").is_file():
        return demo
    return build_random_demo_shape(tmp / "demo-shape")


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


PACK_CHOICES = {"auto": None, "on": True, "off": False}


@dataclass(frozen=True)
class Rate:
    """Decode tokens per wall-clock second and per CPU-second, and the mean wall seconds per step."""

    wall: float
    cpu: float
    step_s: float


def now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def rate(tokens: int, steps: int, start: tuple[float, float], end: tuple[float, float]) -> Rate:
    wall, cpu = end[0] - start[0], end[1] - start[1]
    return Rate(tokens / wall, tokens / max(cpu, 1e-9), wall / max(steps, 1))


def engine_decode_rate(engine, batch: list[list[int]], new_tokens: int) -> Rate:
    """First generated token to last, over all requests."""
    from moemesh.engine import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add_request(f"bench-{i}", p, params)
    engine.step()  # prefill + first token
    steps, tokens = 0, 0
    start = now()
    while engine.has_unfinished():
        tokens += len(engine.step())
        steps += 1
    return rate(tokens, steps, start, now())


class StepClock:
    """A transformers streamer that only notes when each step's tokens arrive (the first call is the prompt)."""

    def __init__(self) -> None:
        self.times: list[tuple[float, float]] = []

    def put(self, value) -> None:
        self.times.append(now())

    def end(self) -> None:
        pass


def hf_decode_rate(model, batch: list[list[int]], new_tokens: int) -> Rate:
    ids = torch.tensor(batch)
    clock = StepClock()
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        streamer=clock,
    )
    gen = clock.times[1:]  # arrival of each generated token
    return rate(len(batch) * (len(gen) - 1), len(gen) - 1, gen[0], gen[-1])


def copy_bandwidth_gbs() -> float:
    """Best-of-5 memory copy bandwidth (bytes read + written per second) on a 256 MB buffer."""
    src = torch.empty(64 * 1024 * 1024, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best / 1e9


def step_matrices(engine) -> list[torch.Tensor]:
    """The weight matrices a decode step multiplies by, as the engine holds them ([out, in] views):
    attention, router, dense MLPs, the experts' concatenated gate_up/down (every token to every expert),
    the LM head."""
    mats = []
    for lyr in engine.model.layers:
        mats += [t for t in (lyr.attn.qkv, lyr.attn.o, lyr.router, lyr.mlp_gate_up, lyr.mlp_down) if t is not None]
    for cat in concatenated_experts(engine):
        mats += [cat.gate_up, cat.down]
    return mats + [engine.model.lm_head]


def concatenated_experts(engine) -> list:
    """The in-process experts' concatenated layouts (`LayerExperts.concatenated`), where held."""
    layers = getattr(engine.experts, "layers", {}).values()
    return [lx.concatenated for lx in layers if lx.concatenated is not None]


def matmul_floor_cpu_s(engine, rows: int, repeats: int = 3) -> float:
    """Best CPU seconds of the step's weight matmuls alone (x[rows, in] @ w.t() for each matrix, same
    tensors and layouts): what a step would cost with zero overhead besides them."""
    from moemesh.models.layers import linear

    mats = step_matrices(engine)
    xs = {(w.shape[1], w.dtype): torch.randn(rows, w.shape[1], dtype=w.dtype) for w in mats}
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.process_time()
        for w in mats:
            linear(xs[(w.shape[1], w.dtype)], w)
        best = min(best, time.process_time() - start)
    return best


def expert_bytes(engine) -> int:
    return sum(lx.weights.nbytes for lx in engine.experts.layers.values())


def bench_dtype(cfg: BenchConfig, model_dir: Path, dtype_name: str, limit_gbs: float) -> None:
    import transformers as tf

    from moemesh.engine import EngineConfig, LLMEngine

    dtype = DTYPES[dtype_name]
    engine = LLMEngine(
        EngineConfig(
            str(model_dir), dtype=dtype_name, max_num_seqs=cfg.concurrent, kv_cache_tokens=cfg.concurrent * 256,
            num_threads=cfg.threads, pack_experts=cfg.pack_experts,
        )
    )
    hf = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    vocab = engine.model_config.vocab_size
    one = prompts(1, cfg.prompt_len, vocab)
    many = prompts(cfg.concurrent, cfg.prompt_len, vocab)
    runs: dict[str, list[Rate]] = {"e1": [], "h1": [], "en": [], "hn": []}
    with torch.inference_mode():
        engine_decode_rate(engine, one, 4)  # warm-up both sides
        hf_decode_rate(hf, one, 4)
        for _ in range(cfg.repeats):
            runs["e1"].append(engine_decode_rate(engine, one, cfg.new_tokens))
            runs["h1"].append(hf_decode_rate(hf, one, cfg.new_tokens))
            runs["en"].append(engine_decode_rate(engine, many, cfg.new_tokens))
            runs["hn"].append(hf_decode_rate(hf, many, cfg.new_tokens))
        floors = {"1": matmul_floor_cpu_s(engine, 1), "n": matmul_floor_cpu_s(engine, cfg.concurrent)}
    best = {k: Rate(max(r.wall for r in v), max(r.cpu for r in v), min(r.step_s for r in v)) for k, v in runs.items()}
    bytes_per_step = engine.model.weight_bytes() + expert_bytes(engine)
    achieved = bytes_per_step / best["e1"].step_s / 1e9
    packed = any(c.gate_up.is_mkldnn for c in concatenated_experts(engine))
    print(f"\n[{dtype_name}] {model_dir} (packed expert copy: {'yes' if packed else 'no'})")
    print(f"{'case':<16}{'moemesh tok/s':>15}{'transformers':>14}{'ratio':>7}   {'moemesh tok/CPU-s':>18}{'transformers':>14}{'ratio':>7}")
    for key, label in (("1", "batch 1"), ("n", f"{cfg.concurrent} concurrent")):
        e, h = best["e" + key], best["h" + key]
        print(f"{label:<16}{e.wall:>15.1f}{h.wall:>14.1f}{e.wall / h.wall:>7.2f}   {e.cpu:>18.1f}{h.cpu:>14.1f}{e.cpu / h.cpu:>7.2f}")
    for key, rows in (("1", 1), ("n", cfg.concurrent)):
        e, h = best["e" + key], best["h" + key]
        step_cpu, floor = rows / e.cpu, floors[key]
        print(
            f"{'batch ' + str(rows) + ' CPU/step':<16}{step_cpu * 1e3:>8.1f} ms, weight matmuls alone {floor * 1e3:.1f} ms "
            f"({floor / step_cpu:.0%}); matmul-only bound {rows / floor:.1f} tok/CPU-s = {rows / floor / h.cpu:.2f}x transformers"
        )
    print(
        f"batch-1 weight traffic: {bytes_per_step / 1e6:.0f} MB/step in {best['e1'].step_s * 1e3:.1f} ms = {achieved:.1f} GB/s; "
        f"copy bandwidth {limit_gbs:.1f} GB/s -> {achieved / limit_gbs:.0%} of the limit"
    )
    on_cpu = bytes_per_step * best["e1"].cpu / 1e9  # per CPU-second of the step (what an idle core would reach)
    print(f"batch-1 weight traffic per CPU-second: {on_cpu:.1f} GB/s -> {on_cpu / limit_gbs:.0%} of the limit")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both sides (1: EngineConfig's default)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--pack-experts", choices=("auto", "on", "off"), default="auto",
                    help="EngineConfig.pack_experts: a oneDNN-packed expert copy (auto: the engine's default)")
    a = ap.parse_args()
    dtypes = tuple(d.strip() for d in a.dtypes.split(",") if d.strip())
    for d in dtypes:
        if d not in DTYPES:
            raise SystemExit(f"--dtypes: unknown dtype {d!r} (choose from {', '.join(DTYPES)})")
    cfg = BenchConfig(a.model, dtypes, a.new_tokens, a.prompt_len, a.concurrent, a.threads, a.repeats, PACK_CHOICES[a.pack_experts])
    torch.set_num_threads(cfg.threads)
    limit = copy_bandwidth_gbs()
    print(f"threads {cfg.threads}, pack_experts {cfg.pack_experts}, {cfg.new_tokens} new tokens, prompts of {cfg.prompt_len}, best of {cfg.repeats}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(cfg.model) if cfg.model else default_model_dir(Path(tmp))
        for d in cfg.dtypes:
            bench_dtype(cfg, model_dir, d, limit)


if __name__ == "__main__":
    main()
