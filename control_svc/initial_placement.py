"""The initial placement: one copy of every MoE layer's experts, balanced over the servers.

A pure function; the EPLB-style solver (control_svc/placement/) replaces it for rebalancing.
"""
from __future__ import annotations

from typing import Sequence

from control_svc.placement.types import Placement


def round_robin_placement(
    layers: Sequence[int], num_experts: int, servers: Sequence[tuple[str, int]], version: int
) -> Placement:
    """servers: (server id, slot budget; 0 = no limit). Walks (layer, expert) pairs in order and
    hands each to the next server in rotation that still has a free slot, so every server ends up
    with ceil or floor of L*E / S experts when budgets allow, and each layer's experts are spread."""
    if not servers:
        raise ValueError("servers: at least one expert server is needed to place experts")
    if num_experts <= 0 or not layers:
        raise ValueError(f"nothing to place: layers {list(layers)}, num_experts {num_experts}")
    need = len(layers) * num_experts
    if all(budget > 0 for _, budget in servers) and sum(b for _, b in servers) < need:
        raise ValueError(
            f"slot_budget: the servers offer {sum(b for _, b in servers)} slots, {need} (layer, expert) pairs need one each"
        )
    used = {sid: 0 for sid, _ in servers}
    budget = dict(servers)
    turn = 0
    replicas: dict[int, tuple[tuple[str, ...], ...]] = {}
    for layer in layers:
        owners = []
        for _ in range(num_experts):
            for step in range(len(servers)):
                sid = servers[(turn + step) % len(servers)][0]
                if budget[sid] == 0 or used[sid] < budget[sid]:
                    break
            used[sid] += 1
            owners.append((sid,))
            turn = (turn + step + 1) % len(servers)
        replicas[layer] = tuple(owners)
    return Placement(version=version, replicas=replicas)
