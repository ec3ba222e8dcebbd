"""Placement solver on skewed synthetic loads: balancedness before/after and copies moved.

For each configuration (logical experts E, servers S x slots, Zipf exponent a) over L layers,
with each layer's expert popularity a random permutation of Zipf(a) ranks:

- `P/E`: copies the servers can hold per layer (one per expert per server at most) / experts;
- `initial`: balancedness of the round-robin placement (one copy per expert) under the load;
- `solved`: after `solve` from the initial placement, and the copies it loads (`moves`);
- `drift 5%`: every count moves by up to +-5%; copies moved by `solve` from the solved placement
  vs by a fresh solve that ignores it (what a solver without the minimal-movement rule would do);
- `shift`: popularity re-drawn (a new permutation): balancedness and moves again.

  python bench/placement.py [--layers 4] [--seed 0] [--tolerance 0.05]
"""
from __future__ import annotations

import argparse
import time

import torch

from control_svc.placement import ServerBudget, balancedness, initial_placement, placement_diff, solve

CONFIGS = [  # (name, E, S, slots per server)
    ("mixtral 8e", 8, 4, 3),
    ("qwen3 128e", 128, 16, 10),
    ("dsv3 256e", 256, 32, 9),
]
EXPONENTS = (0.6, 1.0, 1.4)


def zipf_load(layers: int, experts: int, a: float, g: torch.Generator) -> torch.Tensor:
    """`[L,E]` tokens: expert popularity follows Zipf(a) over a random permutation per layer."""
    ranks = torch.stack([torch.randperm(experts, generator=g) for _ in range(layers)]) + 1
    return (1e6 / ranks.double() ** a).round()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tolerance", type=float, default=0.05)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(args.seed)
    head = (
        f"{'config':<11} {'P/E':>7} {'a':>4} | {'initial':>7} {'solved':>6} {'moves':>5} {'cpu ms':>6} | "
        f"{'drift5%':>7} {'moves':>5} {'fresh':>5} | {'shift':>6} {'moves':>5}"
    )
    print(head)
    print("-" * len(head))
    for name, experts, num_servers, slots in CONFIGS:
        servers = [ServerBudget(f"s{i}", slots) for i in range(num_servers)]
        phys = num_servers * min(slots, experts)
        for a in EXPONENTS:
            load = zipf_load(args.layers, experts, a, g)
            init = initial_placement(range(args.layers), experts, [(s.server_id, s.slots * args.layers) for s in servers], version=0)
            t0 = time.process_time()
            solved = solve(load, servers, current=init, tolerance=args.tolerance)
            ms = (time.process_time() - t0) * 1e3
            drifted = load * (1 + 0.05 * (2 * torch.rand(load.shape, generator=g, dtype=torch.float64) - 1))
            kept = solve(drifted, servers, current=solved, tolerance=args.tolerance)
            fresh = solve(drifted, servers, tolerance=args.tolerance)
            shifted = zipf_load(args.layers, experts, a, g)
            moved = solve(shifted, servers, current=kept, tolerance=args.tolerance)
            print(
                f"{name:<11} {phys:>3}/{experts:<3} {a:>4.1f} | {balancedness(load, init):>7.3f} "
                f"{balancedness(load, solved):>6.3f} {placement_diff(init, solved).moves:>5} {ms:>6.0f} | "
                f"{balancedness(drifted, kept):>7.3f} {placement_diff(solved, kept).moves:>5} "
                f"{placement_diff(solved, fresh).moves:>5} | {balancedness(shifted, moved):>6.3f} "
                f"{placement_diff(kept, moved).moves:>5}"
            )
    print(f"\n{args.layers} layers; moves = expert copies loaded, summed over layers; balancedness = mean/max server load")


if __name__ == "__main__":
    main()
