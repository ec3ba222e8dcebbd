"""The first placement, before any load is known: one copy per expert, dealt round robin."""
from __future__ import annotations

from typing import Sequence

from control_svc.placement.budget import ServerBudget
from control_svc.placement.types import Placement


def _budgets(servers: Sequence[str | ServerBudget], num_experts: int) -> list[ServerBudget]:
    out = [s if isinstance(s, ServerBudget) else ServerBudget(s, num_experts) for s in servers]
    ids = [b.server_id for b in out]
    if not out or len(set(ids)) != len(ids):
        raise ValueError(f"servers must be non-empty with unique ids, got {ids}")
    return out


def initial_placement(
    layers: int | Sequence[int], num_experts: int, servers: Sequence[str | ServerBudget], version: int = 0
) -> Placement:
    """Deal the experts of every layer round robin over the servers that still have a free slot.

    layers: the number of MoE layers (ids 0..L-1) or their ids.  servers: budgets, or plain ids
    (no slot limit).  Layer i starts dealing at server i mod S, so the servers that get one expert
    more than the others (when S does not divide E) change from layer to layer.
    Raises ValueError naming `servers` when the budgets hold fewer than `num_experts` experts.
    """
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    layer_ids = list(range(layers)) if isinstance(layers, int) else list(layers)
    if not layer_ids or len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"layers must be >= 1 or a non-empty list of unique ids, got {layers!r}")
    budgets = _budgets(servers, num_experts)
    room = sum(min(b.slots, num_experts) for b in budgets)
    if room < num_experts:
        raise ValueError(f"servers: slot budgets {[b.slots for b in budgets]} hold {room} experts per layer, need {num_experts}")
    n = len(budgets)
    replicas: dict[int, tuple[tuple[str, ...], ...]] = {}
    for i, layer in enumerate(layer_ids):
        free = [b.slots for b in budgets]
        cursor = i % n
        row = []
        for _ in range(num_experts):
            while free[cursor] == 0:
                cursor = (cursor + 1) % n
            row.append((budgets[cursor].server_id,))
            free[cursor] -= 1
            cursor = (cursor + 1) % n
        replicas[layer] = tuple(row)
    return Placement(version=version, replicas=replicas)
