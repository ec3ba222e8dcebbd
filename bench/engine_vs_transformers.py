"""Decode tokens/s of the moemesh engine vs transformers `generate`, same checkpoint and dtype, with
the weight bytes each step reads, the engine's load time and memory, and every expert format.

  python bench/engine_vs_transformers.py [--shape demo|qwen3-sparse|qwen3-sparse-tiny] [--model DIR]
      [--dtypes float32,bfloat16] [--experts-dtypes bf16,fp8,mxfp4,nvfp4] [--dense-dtype fp8] [--new-tokens 32]
      [--concurrent 16] [--threads 2] [--repeats 2] [--pack-experts auto|on|off] [--no-all-experts-path]

Checkpoints (`bench/shapes.py`): `demo` is the demo model when built (`moemesh demo-model`), else a
random checkpoint of its shape (SmolLM2-135M as an 8-expert Mixtral, top-8 of 8: every token to every
expert); `qwen3-sparse` is a random Qwen3-MoE of realistic proportions (hidden 1024, 16 layers, 64
experts of 384, top-8, 16/4 heads of 64, bf16, 2.7 GB), built once into ~/.cache/moemesh/bench;
`--model DIR` takes any checkpoint instead. `--dense-dtype fp8` holds every engine's attention
projections, dense MLPs and LM head in BlockwiseFP8 (`EngineConfig.dense_dtype`; default: the
compute dtype), transformers keeping them in the compute dtype. `--no-all-experts-path` runs the engine without the path
that computes steps sending every token to every expert as two matmuls over the experts side by side
(`EngineConfig.all_experts_path`): every step then runs `kernels.moe_mlp`.

For each compute dtype of --dtypes it prints:
  1. engine (experts as stored) vs transformers, batch 1 and --concurrent requests decoding together
     (transformers: batched generate on the same prompts), tokens per wall second and per CPU-second
     of each side's process (on an oversubscribed machine with --threads 1 the latter is the rate an
     idle core would reach);
  2. per batch size, the weight bytes a decode step must read (active experts' bytes: expected
     distinct experts per layer for the shape's top-k at that batch, in their served format;
     attention; LM head; see bench/traffic.py) and the GB/s the engine achieved, next to the copy
     bandwidth measured at the start;
  3. the engine's memory: checkpoint bytes on disk, load time (`LLMEngine(...)` in a fresh process,
     started before this process loads the transformers model), peak RSS and its ratio to the checkpoint,
     resident anonymous vs file-backed bytes after decoding (targets of issue 12 for bf16: peak RSS
     <= 1.3x the checkpoint, load <= 5 s);
  4. one row per --experts-dtypes format (`EngineConfig.experts_dtype`, quantized on load): load
     time, peak RSS, batch-1 and --concurrent tok/s, ratio to the bf16 row, GB/s of weight traffic;
     these engines are all loaded together and take turns, one run of each per round, so the
     ratios between formats compare runs minutes apart at most.

Every engine runs in a spawned process of its own (bench/engine_worker.py), so its load time and RSS
are its own; transformers runs in this process. Decode rates exclude the prefill (first generated
token to last, greedy, EOS ignored); each figure is the best of --repeats runs, engine and
transformers interleaved, so a noisy neighbour on a shared machine hurts both sides alike.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

if __name__ == "__main__":  # as a script: the repository root instead of bench/ on sys.path
    _root = Path(__file__).resolve().parent.parent
    sys.path[:] = [str(_root)] + [p for p in sys.path if Path(p or ".").resolve() != _root / "bench"]

from bench.engine_worker import EngineProcess, LoadReport, Memory
from bench.shapes import SHAPES, checkpoint_bytes, checkpoint_dir
from bench.timing import Rate, best, now, rate
from bench.traffic import bandwidth, copy_bandwidth_gbs, expert_bytes, step_bytes
from kernels.prepare import DENSE_DTYPES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EXPERT_FORMATS = ("bf16", "fp8", "mxfp4", "nvfp4")
PACK_CHOICES = {"auto": None, "on": True, "off": False}
RSS_TARGET = 1.3  # peak RSS / checkpoint bytes, bf16 (issue 12)
LOAD_TARGET_S = 5.0


@dataclass(frozen=True)
class BenchConfig:
    shape: str
    model: str | None
    dtypes: tuple[str, ...]
    experts_dtypes: tuple[str, ...]
    new_tokens: int
    prompt_len: int
    concurrent: int
    threads: int
    repeats: int
    pack_experts: bool | None
    all_experts_path: bool = True
    dense_dtype: str | None = None


def comma_list(value: str, choices, flag: str) -> tuple[str, ...]:
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    for v in items:
        if v not in choices:
            raise argparse.ArgumentTypeError(f"{flag}: unknown value {v!r} (choose from {', '.join(choices)})")
    return items


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=tuple(SHAPES), default="demo", help="named checkpoint (bench/shapes.py)")
    ap.add_argument("--model", default=None, help="a checkpoint directory instead of --shape")
    ap.add_argument("--dtypes", type=lambda v: comma_list(v, DTYPES, "--dtypes"), default=tuple(DTYPES))
    ap.add_argument("--experts-dtypes", type=lambda v: comma_list(v, EXPERT_FORMATS, "--experts-dtypes"), default=EXPERT_FORMATS,
                    help="expert formats to compare side by side ('' = none)")
    ap.add_argument("--dense-dtype", choices=DENSE_DTYPES, default=None,
                    help="EngineConfig.dense_dtype of every engine: the attention projections, dense MLPs and LM head in this "
                         "format (default: the compute dtype)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads for both sides (2, as bench/engine_vs_llamacpp.py gives both its sides, so the figures compare)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--pack-experts", choices=tuple(PACK_CHOICES), default="auto",
                    help="EngineConfig.pack_experts: a oneDNN-packed expert copy (auto: the engine's default)")
    ap.add_argument("--all-experts-path", action=argparse.BooleanOptionalAction, default=True,
                    help="EngineConfig.all_experts_path: steps that route every token to every expert as two matmuls over "
                         "the experts side by side (off: kernels.moe_mlp)")
    a = ap.parse_args(argv)
    for name in ("new_tokens", "prompt_len", "concurrent", "threads", "repeats"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.new_tokens < 2:
        ap.error("--new-tokens must be >= 2 (decode is timed from the first generated token to the last)")
    return BenchConfig(a.shape, a.model, a.dtypes, a.experts_dtypes, a.new_tokens, a.prompt_len, a.concurrent,
                       a.threads, a.repeats, PACK_CHOICES[a.pack_experts], a.all_experts_path, a.dense_dtype)


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


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
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, eos_token_id=None, pad_token_id=0, streamer=clock,
    )
    gen = clock.times[1:]  # arrival of each generated token
    return rate(len(batch) * (len(gen) - 1), len(gen) - 1, gen[0], gen[-1])


def engine_config(cfg: BenchConfig, model_dir: Path, dtype: str, experts_dtype: str | None):
    from moemesh.engine import EngineConfig

    return EngineConfig(
        str(model_dir), dtype=dtype, experts_dtype=experts_dtype, dense_dtype=cfg.dense_dtype, max_num_seqs=cfg.concurrent,
        kv_cache_tokens=cfg.concurrent * (cfg.prompt_len + cfg.new_tokens + 16), num_threads=cfg.threads,
        pack_experts=cfg.pack_experts, all_experts_path=cfg.all_experts_path,
    )


@dataclass(frozen=True)
class EngineRun:
    """One engine configuration measured: load, best rates at batch 1 and N, memory after decoding."""

    load: LoadReport
    one: Rate
    many: Rate
    memory: Memory


def measure_engine(cfg: BenchConfig, engine: EngineProcess, one, many, rivals=None) -> tuple[EngineRun, dict]:
    """Warm-up, then --repeats rounds of batch 1 and batch N. `rivals` (name -> fn(batch, new_tokens)
    -> Rate) run interleaved with the engine; their best rates come back keyed (name, "1" | "n")."""
    rivals = rivals or {}
    engine.decode(one, 4)
    for fn in rivals.values():
        fn(one, 4)
    runs: dict[tuple[str, str], list[Rate]] = {}
    for _ in range(cfg.repeats):
        for key, batch in (("1", one), ("n", many)):
            runs.setdefault(("engine", key), []).append(engine.decode(batch, cfg.new_tokens))
            for name, fn in rivals.items():
                runs.setdefault((name, key), []).append(fn(batch, cfg.new_tokens))
    run = EngineRun(engine.load, best(runs[("engine", "1")]), best(runs[("engine", "n")]), engine.memory())
    return run, {k: best(v) for k, v in runs.items() if k[0] != "engine"}


def measure_engines(cfg: BenchConfig, configs: dict, one, many) -> dict[str, EngineRun]:
    """Every configuration's engine loaded at once (one process each), then --repeats rounds in which
    each decodes batch 1 and batch N in turn: the ratios between them compare runs minutes apart at
    most, not separate phases of the bench."""
    with contextlib.ExitStack() as stack:
        engines = {name: stack.enter_context(EngineProcess(c)) for name, c in configs.items()}
        for engine in engines.values():
            engine.decode(one, 4)
        runs: dict[tuple[str, str], list[Rate]] = {}
        for _ in range(cfg.repeats):
            for key, batch in (("1", one), ("n", many)):
                for name, engine in engines.items():
                    runs.setdefault((name, key), []).append(engine.decode(batch, cfg.new_tokens))
        return {name: EngineRun(e.load, best(runs[(name, "1")]), best(runs[(name, "n")]), e.memory()) for name, e in engines.items()}


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def print_memory(run: EngineRun, ckpt: int) -> None:
    m = run.memory
    print(
        f"engine memory: checkpoint {gb(ckpt)} on disk; load {run.load.load_s:.1f} s (target <= {LOAD_TARGET_S:.0f} s); "
        f"peak RSS {gb(m.peak_rss)} = {m.peak_rss / ckpt:.2f}x the checkpoint (target <= {RSS_TARGET}x for bf16; "
        f"{gb(run.load.rss_before)} before loading); resident after decoding: {gb(m.rss_anon)} anonymous, "
        f"{gb(m.rss_file)} file-backed"
    )


def bench_dtype(cfg: BenchConfig, model_dir: Path, dtype_name: str, limit_gbs: float) -> None:
    import transformers as tf

    from moemesh.models.registry import load_model_config

    dtype = DTYPES[dtype_name]
    mcfg = load_model_config(model_dir)
    ckpt = checkpoint_bytes(model_dir)
    one = prompts(1, cfg.prompt_len, mcfg.vocab_size)
    many = prompts(cfg.concurrent, cfg.prompt_len, mcfg.vocab_size)
    n = cfg.concurrent

    # The engine loads first, while this process holds nothing else: with the transformers model
    # already held here its load measured 8-11 s against 1.5-2.5 s alone (docs/benchmarks.md).
    with torch.inference_mode(), EngineProcess(engine_config(cfg, model_dir, dtype_name, None)) as engine:
        hf = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        hf_rate = {"transformers": lambda batch, new: hf_decode_rate(hf, batch, new)}
        run, rivals = measure_engine(cfg, engine, one, many, hf_rate)
    del hf, hf_rate
    gc.collect()

    print(f"\n[{dtype_name}] {model_dir}: {mcfg.architecture}, {len(mcfg.moe_layers)} MoE layers of {mcfg.num_experts} "
          f"experts, top-{mcfg.top_k}")
    print(f"{'case':<16}{'moemesh tok/s':>15}{'transformers':>14}{'ratio':>7}   {'moemesh tok/CPU-s':>18}{'transformers':>14}{'ratio':>7}")
    for key, label, e in (("1", "batch 1", run.one), ("n", f"{n} concurrent", run.many)):
        h = rivals[("transformers", key)]
        print(f"{label:<16}{e.wall:>15.1f}{h.wall:>14.1f}{e.wall / h.wall:>7.2f}   {e.cpu:>18.1f}{h.cpu:>14.1f}{e.cpu / h.cpu:>7.2f}")
    stored = expert_bytes(model_dir, dtype, None)
    for batch, r in ((1, run.one), (n, run.many)):
        traffic = step_bytes(mcfg, dtype, stored, batch, dense_dtype=cfg.dense_dtype)
        step_cpu = batch / r.cpu  # CPU seconds per step
        print(f"batch {batch}: {traffic.describe()}; in {r.step_s * 1e3:.1f} ms = {bandwidth(traffic, r.step_s, limit_gbs)}; "
              f"per CPU-second {traffic.total / step_cpu / 1e9:.1f} GB/s")
    print_memory(run, ckpt)

    if not cfg.experts_dtypes:
        return
    rows = measure_engines(cfg, {fmt: engine_config(cfg, model_dir, dtype_name, fmt) for fmt in cfg.experts_dtypes}, one, many)
    print(f"experts dtype (compute {dtype_name}, --experts-dtype; quantized on load):")
    print(f"{'format':<8}{'load s':>8}{'peak RSS':>10}{'x ckpt':>8}{'batch 1':>10}{'x bf16':>8}{'GB/s':>7}{'copy %':>8}"
          f"{n:>6} conc{'x bf16':>8}{'GB/s':>7}{'copy %':>8}")
    base = rows.get("bf16")
    for fmt, r in rows.items():
        per_expert = expert_bytes(model_dir, dtype, fmt)
        cells = []
        for batch, rt, ref in ((1, r.one, base.one if base else None), (n, r.many, base.many if base else None)):
            gbs = step_bytes(mcfg, dtype, per_expert, batch, dense_dtype=cfg.dense_dtype).total / rt.step_s / 1e9
            ratio = f"{rt.wall / ref.wall:.2f}" if ref else "-"
            cells.append(f"{rt.wall:>10.1f}{ratio:>8}{gbs:>7.1f}{gbs / limit_gbs:>8.0%}")
        print(f"{fmt:<8}{r.load.load_s:>8.1f}{r.memory.peak_rss / 1e9:>9.2f}G{r.memory.peak_rss / ckpt:>8.2f}{cells[0]}{cells[1]}")


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    limit = copy_bandwidth_gbs()
    model_dir = Path(cfg.model) if cfg.model else checkpoint_dir(cfg.shape, progress=lambda m: print(m, file=sys.stderr))
    print(f"{cfg.model or cfg.shape}: {model_dir} ({gb(checkpoint_bytes(model_dir))}); threads {cfg.threads}, "
          f"pack_experts {cfg.pack_experts}, all_experts_path {cfg.all_experts_path}, dense_dtype {cfg.dense_dtype}, {cfg.new_tokens} new tokens, prompts of {cfg.prompt_len}, best of {cfg.repeats}; "
          f"copy bandwidth {limit:.1f} GB/s")
    for d in cfg.dtypes:
        bench_dtype(cfg, model_dir, d, limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
