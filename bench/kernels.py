"""Expert weight formats and grouped expert GEMMs: storage cost and decode-shape speed, side by side.

  python bench/kernels.py [--experts 8] [--hidden 1024] [--intermediate 512] [--tokens 1,4,16,64]
                          [--dtype bfloat16] [--repeat 5] [--device cpu|cuda]

Prints (1) bits per weight of every format, and (2) for each tokens-per-expert count the grouped
GEMM time per format, its ratio to bf16 weights on the same backend, and the achieved GB/s of weight
traffic (stored bytes of the experts used / time). On CPU it also times the plain per-expert loop
(one matmul pair per expert) as the baseline the torch path replaces. On CUDA it runs the Triton
kernels and prints achieved GB/s next to the device's memory bandwidth (target: >= 60% at 16 tokens
per expert). All numbers come from one run on this machine.

Shape legend: E experts, H hidden, I intermediate, T tokens per expert.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # run as `python bench/kernels.py`: this file's folder must not shadow the `kernels` package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from kernels import ExpertWeights, grouped_expert_mlp, prepare_experts  # noqa: E402
from kernels.experts import apply_activation  # noqa: E402

FORMATS = ("bf16", "fp8", "mxfp4", "nvfp4")


def per_expert_loop(x, expert_idx, counts, w: ExpertWeights):
    """The baseline: one gate_up and one down matmul per expert, dense weights only."""
    out = torch.empty_like(x)
    start = 0
    for e, n in zip(expert_idx.tolist(), counts.tolist()):
        rows = x[start : start + n]
        out[start : start + n] = apply_activation(rows @ w.gate_up[e].t(), w.activation) @ w.down[e].t()
        start += n
    return out


def timed_round_robin(fns: dict, repeat: int, device: str) -> dict:
    """Fastest of `repeat` calls of each function, after one warm-up; the functions take turns within
    each round so that load from other processes on a shared machine falls on all of them alike."""
    best = {}
    for name, fn in fns.items():
        fn()
        best[name] = float("inf")
    for _ in range(repeat):
        for name, fn in fns.items():
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def device_bandwidth_gbs(device: str) -> tuple[float | None, float | None]:
    """(theoretical GB/s from NVML or None, measured device-to-device copy GB/s or None)."""
    if device != "cuda":
        return None, None
    theoretical = None
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        clock_mhz = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)
        bus_bits = pynvml.nvmlDeviceGetMemoryBusWidth(h)
        theoretical = 2 * clock_mhz * 1e6 * bus_bits / 8 / 1e9
    except Exception:  # NVML missing or unsupported: only the measured copy bandwidth is printed
        theoretical = None
    src = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = timed_round_robin({"copy": lambda: dst.copy_(src)}, 10, "cuda")["copy"]
    return theoretical, 2 * src.numel() / t / 1e9


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--tokens", default="1,4,16,64", help="tokens per expert, comma separated")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    e, h, i = args.experts, args.hidden, args.intermediate
    torch.manual_seed(0)
    dense = ExpertWeights(torch.randn(e, 2 * i, h) * 0.02, torch.randn(e, h, i) * 0.02)
    weights = {f: prepare_experts(dense, f, dtype) for f in FORMATS}
    stored = dict(weights)
    stored["bf16"] = ExpertWeights(dense.gate_up.to(torch.bfloat16), dense.down.to(torch.bfloat16))
    n_weights = e * 3 * h * i

    print(f"experts E={e} hidden H={h} intermediate I={i} compute={args.dtype} device={args.device}")
    print(f"threads={torch.get_num_threads()}")
    print("\nbytes per weight (weights + scales)")
    print(f"{'format':<8}{'bits/weight':>12}{'MiB':>10}{'vs bf16':>9}")
    for f in FORMATS:
        nbytes = stored[f].nbytes
        print(f"{f:<8}{8 * nbytes / n_weights:>12.4f}{nbytes / 2**20:>10.2f}{nbytes / stored['bf16'].nbytes:>9.3f}")

    theoretical, copy_gbs = device_bandwidth_gbs(args.device)
    backend = "triton" if args.device == "cuda" else "torch"
    moved = {f: w.to(args.device) for f, w in weights.items()}
    expert_idx = torch.arange(e, device=args.device)
    print(f"\ngrouped GEMM, backend={backend}, all {e} experts, ms (fastest of {args.repeat}); ratio = time / bf16 time")
    header = f"{'T/expert':>9}{'format':>8}{'ms':>10}{'ratio':>8}{'GB/s':>9}"
    if args.device == "cpu":
        header += f"{'loop ms':>10}{'loop/this':>10}"
    if copy_gbs:
        header += f"{'% copy bw':>10}" + (f"{'% peak':>8}" if theoretical else "")
    print(header)
    for t in (int(v) for v in args.tokens.split(",")):
        counts = torch.full((e,), t, device=args.device)
        x = torch.randn(e * t, h, device=args.device).to(dtype)
        fns = {f: (lambda w=moved[f]: grouped_expert_mlp(x, expert_idx, counts, w, backend=backend)) for f in FORMATS}
        if args.device == "cpu":
            fns["loop"] = lambda: per_expert_loop(x, expert_idx, counts, moved["bf16"])
        best = timed_round_robin(fns, args.repeat, args.device)
        for f in FORMATS:
            sec = best[f]
            gbs = stored[f].nbytes / sec / 1e9
            line = f"{t:>9}{f:>8}{sec * 1e3:>10.3f}{sec / best['bf16']:>8.2f}{gbs:>9.2f}"
            if args.device == "cpu" and f == "bf16":
                line += f"{best['loop'] * 1e3:>10.3f}{best['loop'] / sec:>10.2f}"
            if copy_gbs:
                line += f"{100 * gbs / copy_gbs:>10.1f}" + (f"{100 * gbs / theoretical:>8.1f}" if theoretical else "")
            print(line)
    if copy_gbs:
        peak = f"{theoretical:.0f} GB/s (NVML)" if theoretical else "n/a"
        print(f"\ndevice memory bandwidth: copy {copy_gbs:.0f} GB/s measured, peak {peak}; target >= 60% at T=16")


if __name__ == "__main__":
    main()
