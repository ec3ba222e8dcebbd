"""Expert weight formats and the routed expert MLP: storage cost and decode-shape speed, side by side.

  python bench/kernel_formats.py [--experts 64] [--top-k 8] [--hidden 1024] [--intermediate 384]
                                 [--tokens 1,4,16,64] [--dtype bfloat16,float32] [--repeat 20]
                                 [--torch-repeat 3] [--threads N] [--device cpu|cuda] [--layers 16]

Prints (1) bits per weight of every format, and (2) for each batch of tokens (each token routed to
--top-k of --experts experts, a fresh routing per call) the time of one `kernels.moe_mlp` call per
format and compute dtype, and the achieved GB/s of weight traffic (stored bytes of the experts the
call selects / time) next to the machine's copy bandwidth (bytes read + written per second by a
large tensor copy). The calls cycle through --layers copies of the experts, as a decode step goes
through its layers, so that every call reads its experts from memory: with one copy the experts
that several routings share stay in the last-level cache between calls (the 4-bit formats then
measured 1.3x faster, FP8 1.6x, bf16 1.15x than from memory: docs/benchmarks.md). On CPU the compiled kernels
(kernels.cpu, the variant named in the header) and the torch path (dequantize, then grouped matmuls)
run side by side; on CUDA the Triton kernels. All numbers come from one run on this machine: the
fastest of --repeat calls (a shared machine slows some calls, never speeds any up).

Shape legend: E experts, H hidden, I intermediate, T tokens per call, G experts selected by a call.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

from kernels import ExpertWeights, moe_mlp, prepare_experts
from kernels.cpu.variant import selected_variant

FORMATS = ("bf16", "fp8", "mxfp4", "nvfp4")
ROUTINGS = 16  # distinct routings cycled through, so consecutive calls read different experts


def routing(tokens: int, experts: int, top_k: int, seed: int, device: str):
    """-> token_idx [N], row_weight [N], expert_idx [G], counts [G]: rows grouped by expert."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).flatten()  # [T*k]
    order = torch.argsort(chosen, stable=True)
    token_idx = torch.arange(tokens).repeat_interleave(top_k)[order]
    expert_idx, counts = torch.unique_consecutive(chosen[order], return_counts=True)
    weight = torch.rand(token_idx.numel(), generator=g)
    return tuple(t.to(device) for t in (token_idx, weight, expert_idx, counts))


def fastest(fn, calls: list, repeat: int, device: str) -> float:
    """Fastest wall-clock seconds of `repeat` calls fn(*calls[i % len(calls)]), after one warm-up call of
    each (a new row-count pattern can cost a one-off setup in the torch path)."""
    for c in calls:
        fn(*c)
    best = float("inf")
    for i in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*calls[i % len(calls)])
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth_gbs(device: str) -> float:
    """Bytes read + written per second by a 256 MiB tensor copy (fastest of 5)."""
    src = torch.empty(2**28, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = fastest(lambda: dst.copy_(src), [()], 5, device)
    return 2 * src.numel() / t / 1e9


def stored_weights(dense: ExpertWeights, fmt: str, dtype: torch.dtype) -> ExpertWeights:
    """The experts as a checkpoint in `fmt` holds them: bf16 weights stay bfloat16 for either compute dtype."""
    if fmt == "bf16":
        return ExpertWeights(dense.gate_up.to(torch.bfloat16), dense.down.to(torch.bfloat16))
    return prepare_experts(dense, fmt, dtype)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=384)
    ap.add_argument("--tokens", default="1,4,16,64", help="tokens per call, comma separated")
    ap.add_argument("--dtype", default="bfloat16,float32", help="compute dtypes, comma separated")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--torch-repeat", type=int, default=3, help="calls of the (slow) torch path on CPU")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=16, help="copies of the experts the calls cycle through (see above)")
    args = ap.parse_args(argv)
    if args.layers < 1:
        ap.error(f"--layers must be >= 1, got {args.layers}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    e, h, i, k = args.experts, args.hidden, args.intermediate, args.top_k
    torch.manual_seed(0)
    dense = ExpertWeights(torch.randn(e, 2 * i, h) * 0.02, torch.randn(e, h, i) * 0.02)
    n_weights = e * 3 * h * i
    cpu = args.device == "cpu"
    variant = selected_variant() if cpu else None
    backends = (["cpu"] if variant else []) + ["torch"] if cpu else ["triton"]

    print(f"experts E={e} top-k={k} hidden H={h} intermediate I={i} device={args.device} threads={torch.get_num_threads()} "
          f"layers={args.layers}")
    if cpu:
        print(f"compiled CPU kernel variant: {variant or 'none (torch path only)'}")
    print("\nbytes per weight (weights + scales)")
    print(f"{'format':<8}{'bits/weight':>12}{'MiB':>10}{'vs bf16':>9}")
    bf16_bytes = stored_weights(dense, "bf16", torch.bfloat16).nbytes
    for f in FORMATS:
        nbytes = stored_weights(dense, f, torch.float32).nbytes
        print(f"{f:<8}{8 * nbytes / n_weights:>12.4f}{nbytes / 2**20:>10.2f}{nbytes / bf16_bytes:>9.3f}")

    copy_gbs = copy_bandwidth_gbs(args.device)
    print(f"\ncopy bandwidth: {copy_gbs:.1f} GB/s (read + written)")
    print(f"moe_mlp per call, fastest of {args.repeat} (torch path on CPU: {args.torch_repeat}); GB/s = stored bytes of the selected experts / time")
    cols = "".join(f"{b + ' ms':>12}{b + ' GB/s':>13}{'%copy':>7}" for b in backends)
    print(f"{'T':>4}{'G':>4}{'format':>8}{'compute':>10}{cols}" + (f"{'speedup':>9}" if len(backends) > 1 else ""))
    for dtype_name in args.dtype.split(","):
        dtype = getattr(torch, dtype_name)
        for f in FORMATS:
            w0 = stored_weights(dense, f, dtype).to(args.device)
            layers = [w0] + [copy.deepcopy(w0) for _ in range(args.layers - 1)]  # L copies of the experts
            per_expert = w0.nbytes / e
            for t in (int(v) for v in args.tokens.split(",")):
                calls = [routing(t, e, k, seed, args.device) for seed in range(ROUTINGS)]
                xs = torch.randn(t, h, device=args.device).to(dtype)
                g = min(len(c[2]) for c in calls)
                line = f"{t:>4}{g:>4}{f:>8}{dtype_name:>10}"
                times = {}
                for b in backends:
                    repeat = args.torch_repeat if b == "torch" else args.repeat
                    # call i: routing i % ROUTINGS on copy i % L
                    calls_l = [(*calls[i % len(calls)], layers[i % len(layers)]) for i in range(max(len(calls), len(layers)))]
                    times[b] = fastest(lambda *r, b=b: moe_mlp(xs, *r, backend=b), calls_l, repeat, args.device)
                    gbs = g * per_expert / times[b] / 1e9
                    line += f"{times[b] * 1e3:>12.3f}{gbs:>13.1f}{100 * gbs / copy_gbs:>7.0f}"
                if len(backends) > 1:
                    line += f"{times['torch'] / times['cpu']:>8.1f}x"
                print(line, flush=True)


if __name__ == "__main__":
    main()
