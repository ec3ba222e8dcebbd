"""Decode tokens/s of llama.cpp and the moemesh engine on the same checkpoint and prompt, with bf16
and 4-bit experts, side by side from one run: the anchor for a CPU decode that reads each active
expert's bytes once.

  pip install -e .[bench]   # llama-cpp-python, compiled from source by pip (cmake, a C++ compiler;
                            # CMAKE_ARGS=-DLLAVA_BUILD=OFF skips its multimodal library)
  python bench/engine_vs_llamacpp.py [--shape qwen3-sparse] [--model DIR] [--new-tokens 64] [--threads 2]
      [--repeats 3] [--llama-4bit mxfp4|q4_0] [--dense-dtype fp8] [--sdist llama_cpp_python-X.tar.gz]

The checkpoint (bench/shapes.py; default the random Qwen3-MoE of realistic proportions, 64 experts,
top-8, bf16, 2.7 GB, with the demo model's tokenizer) is converted with llama.cpp's own
`convert_hf_to_gguf.py` from the llama-cpp-python source package of the installed version, then
quantized with llama.cpp's quantizer (bench/llamacpp_gguf.py); GGUF files are cached under
~/.cache/moemesh/bench/gguf. Rows:
  bf16    llama.cpp: the bf16 GGUF            moemesh: experts as stored (bf16), compute bf16
  4-bit   llama.cpp: --llama-4bit (default MXFP4_MOE: experts MXFP4, other matrices Q8_0; falls
          back to Q4_0, and says so, where the quantizer refuses MXFP4 for the architecture)
          moemesh: --experts-dtype mxfp4 (other matrices bf16), compute bf16
  nvfp4   llama.cpp: the same 4-bit GGUF, measured again beside this row's engine
          moemesh: --experts-dtype nvfp4 (other matrices bf16), compute bf16 (llama.cpp has no
          NVFP4: its 4-bit rate is the anchor)
  4-bit+8 llama.cpp: the same 4-bit GGUF, measured again beside this row's engine
          moemesh: --experts-dtype mxfp4 with the attention projections and LM head in BlockwiseFP8
          (`EngineConfig.dense_dtype="fp8"`): the configuration of llama.cpp's MXFP4_MOE (8-bit
          matrices beside 4-bit experts), compute bf16
--dense-dtype sets the dense format of the bf16, 4-bit and nvfp4 rows' engines (default: bf16, as above).
Both sides decode greedily, batch 1, from the same prompt token ids, with --threads threads
(llama.cpp n_threads; torch threads in the engine's own process, bench/engine_worker.py), timed
from the first generated token to the last (prefill excluded); each figure is the best of --repeats
runs, after 32 untimed tokens on each side (llama.cpp maps the GGUF into memory, so an expert is
paged in when first used). Both llama.cpp models and the four engines stay loaded together and
take turns, one run each per round, so that every ratio (moemesh/llama.cpp in a row, and 4-bit/bf16
on either side) compares runs taken minutes apart at most. Printed: tokens per second and ms per step of
each side, the moemesh/llama.cpp ratio per row, each side's 4-bit/bf16 ratio, and the load times.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # as a script: the repository root instead of bench/ on sys.path
    _root = Path(__file__).resolve().parent.parent
    sys.path[:] = [str(_root)] + [p for p in sys.path if Path(p or ".").resolve() != _root / "bench"]

from bench.shapes import SHAPES, checkpoint_dir
from bench.timing import Rate, best, now, rate
from kernels.prepare import DENSE_DTYPES

PROMPT = "The history of the printing press begins in the fifteenth century, when"
SWITCH_PAUSE_S = 0.3  # between the two sides: the other side's idle OpenMP threads stop spinning
# Untimed tokens first on each side: llama.cpp memory-maps the GGUF, so an expert's pages are first
# touched when a token is first routed to it; 32 tokens of top-8 of 64 touch ~98% of the experts.
WARMUP_TOKENS = 32


@dataclass(frozen=True)
class Side:
    """One measured side of a row: best rate and load seconds."""

    rate: Rate
    load_s: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-sparse", help="named checkpoint (bench/shapes.py)")
    ap.add_argument("--model", default=None, help="a checkpoint directory instead of --shape (needs a tokenizer llama.cpp knows)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-4bit", choices=("mxfp4", "q4_0"), default="mxfp4", help="llama.cpp's 4-bit type")
    ap.add_argument("--dense-dtype", choices=DENSE_DTYPES, default=None,
                    help="EngineConfig.dense_dtype of the bf16 and 4-bit rows' engines (the 4-bit+8 row always holds them in fp8)")
    ap.add_argument("--sdist", type=Path, default=None, help="a llama-cpp-python source package to take the converter from "
                    "(default: pip download of the installed version)")
    a = ap.parse_args(argv)
    if a.new_tokens < 2 or a.threads < 1 or a.repeats < 1:
        ap.error(f"need --new-tokens >= 2, --threads >= 1, --repeats >= 1, got {a.new_tokens}, {a.threads}, {a.repeats}")
    if a.sdist is not None and not a.sdist.is_file():
        ap.error(f"--sdist: no such file {a.sdist}")
    return a


def prompt_ids(model_dir: Path) -> list[int]:
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise SystemExit(f"{model_dir} has no tokenizer.json (llama.cpp's converter needs the checkpoint's tokenizer)")
    return Tokenizer.from_file(str(path)).encode(PROMPT).ids


def llama_decode_rate(llm, prompt: list[int], new_tokens: int) -> Rate:
    """Greedy decode through llama-cpp-python's `generate`, first generated token to last."""
    times = []
    for _ in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        times.append(now())
        if len(times) == new_tokens:
            break
    return rate(len(times) - 1, len(times) - 1, times[0], times[-1])


def gguf_files(model_dir: Path, a: argparse.Namespace, progress) -> tuple[Path, Path, str]:
    """(bf16 GGUF, 4-bit GGUF, the 4-bit kind made)."""
    from bench.llamacpp_gguf import gguf_file

    bf16 = gguf_file(model_dir, "bf16", a.threads, a.sdist, progress)
    try:
        return bf16, gguf_file(model_dir, a.llama_4bit, a.threads, a.sdist, progress), a.llama_4bit
    except RuntimeError as e:
        if a.llama_4bit != "mxfp4":
            raise
        progress(f"llama.cpp's quantizer refused MXFP4 here ({e}); using Q4_0")
        return bf16, gguf_file(model_dir, "q4_0", a.threads, a.sdist, progress), "q4_0"


def measure_rows(
    model_dir: Path, ggufs: dict[str, Path], engines: dict[str, tuple[str | None, str | None]], prompt: list[int], a
) -> tuple[dict[str, Side], dict[str, Side]]:
    """Every llama.cpp model (name -> GGUF) and every engine (name -> (experts_dtype, dense_dtype)) loaded
    at once, then --repeats rounds in which each runs once, one after another: ratios between any two
    of them (across rows too) come from runs minutes apart at most, not from separate phases of the
    bench. -> (llama.cpp sides by GGUF name, moemesh sides by engine name)."""
    from llama_cpp import Llama

    from bench.engine_worker import EngineProcess
    from moemesh.engine import EngineConfig

    n_ctx = len(prompt) + max(a.new_tokens, WARMUP_TOKENS) + 32
    llms, llama_load = {}, {}
    with contextlib.ExitStack() as stack:
        for name, gguf in ggufs.items():
            start = time.perf_counter()
            llms[name] = Llama(str(gguf), n_ctx=n_ctx, n_batch=max(len(prompt), 32), n_threads=a.threads,
                               n_threads_batch=a.threads, verbose=False)
            llama_load[name] = time.perf_counter() - start
            stack.callback(llms[name].close)
        procs = {}
        for name, (experts_dtype, dense_dtype) in engines.items():
            config = EngineConfig(str(model_dir), dtype="bfloat16", experts_dtype=experts_dtype, dense_dtype=dense_dtype,
                                  num_threads=a.threads, max_num_seqs=1, kv_cache_tokens=n_ctx)
            procs[name] = stack.enter_context(EngineProcess(config))
        runs = {("llama", n): (lambda llm=llm: llama_decode_rate(llm, prompt, a.new_tokens)) for n, llm in llms.items()}
        runs.update({("moemesh", n): (lambda e=e: e.decode([prompt], a.new_tokens)) for n, e in procs.items()})
        for llm in llms.values():
            llama_decode_rate(llm, prompt, WARMUP_TOKENS)
        for engine in procs.values():
            engine.decode([prompt], WARMUP_TOKENS)
        rates: dict[tuple[str, str], list[Rate]] = {key: [] for key in runs}
        for _ in range(a.repeats):
            for key, run in runs.items():
                time.sleep(SWITCH_PAUSE_S)
                rates[key].append(run())
        theirs = {n: Side(best(rates[("llama", n)]), llama_load[n]) for n in llms}
        ours = {n: Side(best(rates[("moemesh", n)]), e.load.load_s) for n, e in procs.items()}
        return theirs, ours


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from bench.llamacpp_gguf import QUANT_DESCRIPTIONS, LlamaCppMissing, installed_version

    try:
        version = installed_version()
    except LlamaCppMissing as e:
        print(f"bench/engine_vs_llamacpp.py: {e}", file=sys.stderr)
        return 2
    progress = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    model_dir = Path(a.model) if a.model else checkpoint_dir(a.shape, progress)
    prompt = prompt_ids(model_dir)
    bf16_gguf, q_gguf, q_kind = gguf_files(model_dir, a, progress)
    dense = a.dense_dtype or "bf16"
    rows = {  # name: (GGUF, its kind, moemesh experts_dtype, moemesh dense_dtype, moemesh's formats)
        "bf16": (bf16_gguf, "bf16", None, a.dense_dtype, f"experts as stored (bf16), other matrices {dense}"),
        "4-bit": (q_gguf, q_kind, "mxfp4", a.dense_dtype, f"--experts-dtype mxfp4, other matrices {dense}"),
        "nvfp4": (q_gguf, q_kind, "nvfp4", a.dense_dtype, f"--experts-dtype nvfp4, other matrices {dense}"),
        "4-bit+8": (q_gguf, q_kind, "mxfp4", "fp8", "--experts-dtype mxfp4 --dense-dtype fp8 (attention, LM head BlockwiseFP8)"),
    }
    theirs, ours = measure_rows(model_dir, {"bf16": bf16_gguf, "4-bit": q_gguf},
                                {name: (fmt, dfmt) for name, (_, _, fmt, dfmt, _) in rows.items()}, prompt, a)
    results = {name: (theirs["bf16" if name == "bf16" else "4-bit"], ours[name]) for name in rows}
    print(f"{a.model or a.shape}: {model_dir}; llama.cpp from llama-cpp-python {version}; {a.threads} threads each side; "
          f"prompt of {len(prompt)} tokens, {a.new_tokens} new tokens (greedy, batch 1), best of {a.repeats}")
    print(f"{'row':<7}{'llama.cpp tok/s':>16}{'ms/step':>9}{'moemesh tok/s':>15}{'ms/step':>9}{'moemesh/llama.cpp':>19}   formats")
    for name, (gguf, kind, _, _, ours_desc) in rows.items():
        theirs, ours = results[name]
        print(f"{name:<7}{theirs.rate.wall:>16.1f}{theirs.rate.step_s * 1e3:>9.1f}{ours.rate.wall:>15.1f}{ours.rate.step_s * 1e3:>9.1f}"
              f"{ours.rate.wall / theirs.rate.wall:>19.2f}   llama.cpp {QUANT_DESCRIPTIONS[kind]}; moemesh {ours_desc}")
    (lb, mb_), (lq, mq), (_, mn), (lq8, mq8) = (results[name] for name in ("bf16", "4-bit", "nvfp4", "4-bit+8"))
    print(f"4-bit / bf16: llama.cpp {lq.rate.wall / lb.rate.wall:.2f}x, moemesh {mq.rate.wall / mb_.rate.wall:.2f}x "
          f"(nvfp4: {mn.rate.wall / mb_.rate.wall:.2f}x, 4-bit+8: {mq8.rate.wall / mb_.rate.wall:.2f}x); "
          f"moemesh 4-bit / llama.cpp bf16 {mq.rate.wall / lb.rate.wall:.2f}x")
    print(f"load s: llama.cpp bf16 {lb.load_s:.1f}, {q_kind} {lq.load_s:.1f}, {lq8.load_s:.1f} (memory-mapped GGUF); "
          f"moemesh bf16 {mb_.load_s:.1f}, mxfp4 {mq.load_s:.1f}, nvfp4 {mn.load_s:.1f}, mxfp4+fp8 {mq8.load_s:.1f} "
          f"(fresh process, quantized on load)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
