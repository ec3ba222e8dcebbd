"""Expert weight formats and grouped expert GEMMs: storage cost and decode-shape speed, side by side.

  python bench/kernel_formats.py [--experts 8] [--hidden 1024] [--intermediate 512] [--tokens 1,4,16,64]
                                 [--dtype bfloat16] [--repeat 5] [--threads N] [--device cpu|cuda]

Prints (1) bits per weight of every format, and (2) for each tokens-per-expert count the grouped
GEMM time per format, its ratio to bf16 weights on the same backend, and the achieved GB/s of weight
traffic (stored bytes of the experts used / time). On CPU it also times the plain per-expert loop
(one matmul pair per expert) as the baseline the torch path replaces, the quantized formats with an
opt-in `DequantizedWeights` store (rows "<fmt>+cache": dense copies kept between calls, memory for
speed), and next to wall-clock ms the CPU ms of this process (on a shared, oversubscribed machine
with --threads 1 that is what a call costs on an idle core). Target on CPU: quantized formats
within 3x of bf16 at 1-16 tokens per expert. On CUDA it runs the Triton kernels and prints achieved
GB/s next to the device's memory bandwidth (target: >= 60% at 16 tokens per expert). All numbers
come from one run on this machine.

Shape legend: E experts, H hidden, I intermediate, T tokens per expert.
"""
from __future__ import annotations

import argparse
import time

import torch

from kernels import DequantizedWeights, ExpertWeights, grouped_expert_mlp, prepare_experts
from kernels.experts import apply_activation

FORMATS = ("bf16", "fp8", "mxfp4", "nvfp4")
QUANTIZED = FORMATS[1:]
TARGET_RATIO = 3.0


def per_expert_loop(x, expert_idx, counts, w: ExpertWeights):
    """The baseline: one gate_up and one down matmul per expert, dense weights only."""
    out = torch.empty_like(x)
    start = 0
    for e, n in zip(expert_idx.tolist(), counts.tolist()):
        rows = x[start : start + n]
        out[start : start + n] = apply_activation(rows @ w.gate_up[e].t(), w.activation) @ w.down[e].t()
        start += n
    return out


def timed_round_robin(fns: dict, repeat: int, device: str) -> tuple[dict, dict]:
    """Fastest wall-clock and fastest process-CPU seconds of `repeat` calls of each function, after one
    warm-up; the functions take turns within each round so that load from other processes on a
    shared machine falls on all of them alike."""
    best, cpu = {}, {}
    for name, fn in fns.items():
        fn()
        best[name] = cpu[name] = float("inf")
    for _ in range(repeat):
        for name, fn in fns.items():
            if device == "cuda":
                torch.cuda.synchronize()
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            best[name] = min(best[name], time.perf_counter() - t0)
            cpu[name] = min(cpu[name], time.process_time() - c0)
    return best, cpu


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
    t = timed_round_robin({"copy": lambda: dst.copy_(src)}, 10, "cuda")[0]["copy"]
    return theoretical, 2 * src.numel() / t / 1e9


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--tokens", default="1,4,16,64", help="tokens per expert, comma separated")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
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
    cpu_rows = args.device == "cpu"
    print(f"\ngrouped GEMM, backend={backend}, all {e} experts, ms (fastest of {args.repeat}); ratio = time / bf16 time")
    header = f"{'T/expert':>9}{'format':>12}{'ms':>10}{'ratio':>8}{'GB/s':>9}"
    if cpu_rows:
        header += f"{'cpu ms':>10}{'cpu ratio':>10}{'loop ms':>10}{'loop/this':>10}"
    if copy_gbs:
        header += f"{'% copy bw':>10}" + (f"{'% peak':>8}" if theoretical else "")
    print(header)
    worst: dict[str, float] = {}
    worst_cpu: dict[str, float] = {}
    for t in (int(v) for v in args.tokens.split(",")):
        counts = torch.full((e,), t, device=args.device)
        x = torch.randn(e * t, h, device=args.device).to(dtype)
        fns = {f: (lambda w=moved[f]: grouped_expert_mlp(x, expert_idx, counts, w, backend=backend)) for f in FORMATS}
        if cpu_rows:
            for f in QUANTIZED:  # the opt-in store; the warm-up call fills it
                fns[f + "+cache"] = lambda w=moved[f], c=DequantizedWeights(): grouped_expert_mlp(x, expert_idx, counts, w, cache=c)
            fns["loop"] = lambda: per_expert_loop(x, expert_idx, counts, moved["bf16"])
        best, cpu = timed_round_robin(fns, args.repeat, args.device)
        for name in (n for n in fns if n != "loop"):
            sec, f = best[name], name.split("+")[0]
            gbs = stored[f].nbytes / sec / 1e9
            line = f"{t:>9}{name:>12}{sec * 1e3:>10.3f}{sec / best['bf16']:>8.2f}{gbs:>9.2f}"
            if cpu_rows:
                line += f"{cpu[name] * 1e3:>10.3f}{cpu[name] / cpu['bf16']:>10.2f}"
                if name == "bf16":
                    line += f"{best['loop'] * 1e3:>10.3f}{best['loop'] / sec:>10.2f}"
                if t <= 16 and name != "bf16":
                    worst[name] = max(worst.get(name, 0.0), sec / best["bf16"])
                    worst_cpu[name] = max(worst_cpu.get(name, 0.0), cpu[name] / cpu["bf16"])
            if copy_gbs:
                line += f"{100 * gbs / copy_gbs:>10.1f}" + (f"{100 * gbs / theoretical:>8.1f}" if theoretical else "")
            print(line)
    if worst:
        print(f"\nworst ratio to bf16 at 1-16 tokens per expert (target <= {TARGET_RATIO:g}x), wall-clock / CPU time:")
        for n, r in worst.items():
            print(f"  {n:<12}{r:>7.2f}x{worst_cpu[n]:>8.2f}x")
    if copy_gbs:
        peak = f"{theoretical:.0f} GB/s (NVML)" if theoretical else "n/a"
        print(f"\ndevice memory bandwidth: copy {copy_gbs:.0f} GB/s measured, peak {peak}; target >= 60% at T=16")


if __name__ == "__main__":
    main()
