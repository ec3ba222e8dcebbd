"""The placement solver: from observed expert load to the next `Placement`, moving as little as it can.

Shape letters: L layers, E logical experts, P physical slots (copies) per layer, S servers.

`solve` = `replicate` (how many copies per expert) + placing the copies on servers, per layer.
The balance cost of a layer is its peak server load (every MoE layer waits for its slowest
server); the movement cost is the number of copies a server must load that it does not hold now.
For each layer the solver builds candidates:

1. a fresh balanced packing (`pack`, heaviest copy first onto the least-loaded server), sticky:
   a copy goes to a server that already holds its expert when that server's load is at most
   `tolerance * mean server load` above the least-loaded one;
2. the incremental path (`refine.incremental`): current copies kept, missing copies added, then
   one move, swap or re-replication at a time around the busiest server, every intermediate
   state a candidate;
3. the current layer itself, when still valid (every expert has a copy, only servers in
   `servers`, each within its slots, P copies, no two copies of an expert on a server).

With `num_physical` left to the solver, the candidates of both copy counts it tries compete.

The rule: among the candidates whose peak is within `(1 + tolerance)` of the best peak, take the
one that moves fewest copies (then the lower peak). So a small load drift moves nothing, and a
real skew moves only the copies needed to come within `tolerance` of the best balance found.
The pass is then repeated from its own result (at most `POLISH_ROUNDS` more times, stopping when
nothing changes): a new starting point often opens a better local optimum, and the result is then
a fixed point, so solving again with the same load returns it unchanged and small drifts rarely
unlock a gain worth moving for.
The building blocks are exported here too: `replicate`, `pack`, `balancedness`, `server_loads`,
`initial_placement`, `placement_diff`.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from control_svc.placement.balance import balancedness, server_loads
from control_svc.placement.budget import ServerBudget
from control_svc.placement.diff import PlacementDiff, placement_diff
from control_svc.placement.initial import initial_placement
from control_svc.placement.pack import pack
from control_svc.placement.refine import incremental
from control_svc.placement.replicate import as_load, replicate, slot_capacity
from control_svc.placement.types import Placement

__all__ = [
    "ServerBudget", "PlacementDiff", "balancedness", "initial_placement", "pack", "placement_diff",
    "replicate", "server_loads", "solve",
]

Row = tuple[tuple[str, ...], ...]
POLISH_ROUNDS = 2  # extra passes from the pass's own result, until it stops changing


def _check_servers(servers: Sequence[ServerBudget]) -> None:
    if not servers:
        raise ValueError("servers must list at least one ServerBudget")
    for s in servers:
        if not isinstance(s, ServerBudget):
            raise ValueError(f"servers must hold ServerBudget values, got {s!r}")
    ids = [s.server_id for s in servers]
    if len(set(ids)) != len(ids):
        raise ValueError(f"servers must have unique server_id values, got {ids}")


def _row_valid(row: Row, servers: Sequence[ServerBudget], num_experts: int, totals: Sequence[int]) -> bool:
    if len(row) != num_experts:
        return False
    slots = {s.server_id: s.slots for s in servers}
    used: dict[str, int] = {}
    for copies in row:
        if not copies or len(set(copies)) != len(copies):
            return False
        for s in copies:
            if s not in slots:
                return False
            used[s] = used.get(s, 0) + 1
    return sum(used.values()) in totals and all(n <= slots[s] for s, n in used.items())


def _ordered(before: tuple[str, ...], now: set[str], ids: list[str]) -> tuple[str, ...]:
    """Copies that stay keep their order; new copies follow in `servers` order."""
    kept = [s for s in before if s in now]
    return tuple(kept + [s for s in ids if s in now and s not in kept])


def _row(groups: torch.Tensor, assignment: torch.Tensor, old: Row | None, ids: list[str], num_experts: int) -> Row:
    """Placement row from copy p of expert `groups[p]` on server `ids[assignment[p]]`."""
    on: list[set[str]] = [set() for _ in range(num_experts)]
    for e, s in zip(groups.tolist(), assignment.tolist()):
        on[e].add(ids[s])
    before = old if old is not None and len(old) == num_experts else ((),) * num_experts
    return tuple(_ordered(before[e], on[e], ids) for e in range(num_experts))


def _peak(load_row: torch.Tensor, row: Row, ids: list[str]) -> float:
    p = Placement(version=0, replicas={0: row})
    return float(server_loads(load_row, p, ids, [0]).max())


def _solve_rows(
    w: torch.Tensor, servers: Sequence[ServerBudget], totals: Sequence[int], old_rows: list[Row | None], tolerance: float
) -> list[Row]:
    """One pass of the rule in the module docstring over every layer: `w[L,E]`, `old_rows[L]`."""
    num_layers, num_experts = w.shape
    ids = [s.server_id for s in servers]
    slots = [s.slots for s in servers]
    budget = torch.as_tensor(slots, dtype=torch.int64)
    held = torch.zeros(num_layers, num_experts, len(servers), dtype=torch.bool)
    col = {s: i for i, s in enumerate(ids)}
    for row_i, row in enumerate(old_rows):
        if row is not None and len(row) == num_experts:
            for e, copies in enumerate(row):
                for s in copies:
                    if s in col:
                        held[row_i, e, col[s]] = True

    # (peak server load, copies moved, row builder) per layer, over every copy count tried
    options: list[list[tuple[float, int, Callable[[], Row]]]] = [[] for _ in range(num_layers)]
    for p in totals:
        phy2log, _, logcnt = replicate(w, p, slots)
        weights = w.gather(1, phy2log) / logcnt.gather(1, phy2log)
        fresh = pack(weights, len(servers), slots, groups=phy2log, held=held, tolerance=tolerance)
        for row_i in range(num_layers):
            hl = held[row_i]
            for g, a in [(phy2log[row_i], fresh[row_i]), *incremental(w[row_i], phy2log[row_i], hl, budget, max_steps=p)]:
                wt = w[row_i, g] / torch.bincount(g, minlength=num_experts)[g]
                peak = float(torch.zeros(len(servers), dtype=torch.float64).index_add_(0, a, wt).max())
                build = lambda g=g, a=a, old=old_rows[row_i]: _row(g, a, old, ids, num_experts)  # noqa: E731
                options[row_i].append((peak, int((~hl[g, a]).sum()), build))
    out: list[Row] = []
    for row_i, old in enumerate(old_rows):
        if old is not None and _row_valid(old, servers, num_experts, totals):
            options[row_i].append((_peak(w[row_i], old, ids), 0, lambda old=old: old))
        limit = (1 + tolerance) * min(o[0] for o in options[row_i])
        out.append(min((o for o in options[row_i] if o[0] <= limit), key=lambda o: (o[1], o[0]))[2]())
    return out


def solve(
    load,
    servers: Sequence[ServerBudget],
    num_physical: int | None = None,
    current: Placement | None = None,
    *,
    layer_ids: Sequence[int] | None = None,
    tolerance: float = 0.05,
) -> Placement:
    """The next placement for expert load `load[L,E]` (token counts per layer and logical expert).

    servers: the expert servers and their per-layer slot budgets.  num_physical: P, the total
    copies per layer (E <= P). By default each layer gets whichever is better of one copy per
    expert (P = E) and every slot the servers have (up to one copy of an expert per server):
    with uneven budgets, filling every slot can force copies onto the big server that add to its
    load, so the solver compares both (the current layer is kept if its copy count is either).
    current: the placement in force (its copies are kept where the rules above allow).
    layer_ids: the placement layer id of each row of `load` (default 0..L-1).
    tolerance: relative balance cost accepted to avoid a move (>= 0).

    Layers of `current` not named in `layer_ids` are carried over unchanged.
    Returns `current` itself when nothing changes, else a Placement with version
    `current.version + 1` (0 without `current`).
    Raises ValueError naming the field when the budgets cannot hold every expert or P copies.
    """
    w = as_load(load)
    num_layers, num_experts = w.shape
    _check_servers(servers)
    slots = [s.slots for s in servers]
    capacity = int(slot_capacity(slots, num_experts)[-1])
    if capacity < num_experts:
        raise ValueError(f"servers: slot budgets {slots} hold {capacity} distinct experts per layer, need {num_experts}")
    if num_physical is None:
        totals = sorted({num_experts, capacity})
    elif isinstance(num_physical, bool) or not isinstance(num_physical, int) or not num_experts <= num_physical <= capacity:
        raise ValueError(f"num_physical must be an int in [{num_experts}, {capacity}] for these servers, got {num_physical!r}")
    else:
        totals = [num_physical]
    layers = list(range(num_layers)) if layer_ids is None else list(layer_ids)
    if len(layers) != num_layers or len(set(layers)) != num_layers:
        raise ValueError(f"layer_ids must name {num_layers} distinct layers, got {layer_ids!r}")
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance!r}")

    rows = [current.replicas.get(layer) if current is not None else None for layer in layers]
    todo = list(range(num_layers))
    for _ in range(1 + POLISH_ROUNDS):  # re-solve the layers the last pass changed
        solved = _solve_rows(w[todo], servers, totals, [rows[i] for i in todo], tolerance)
        changed = [i for i, row in zip(todo, solved) if row != rows[i]]
        for i, row in zip(todo, solved):
            rows[i] = row
        if not changed:
            break
        todo = changed
    new = dict(zip(layers, rows))
    if current is not None:
        merged = dict(current.replicas)
        merged.update(new)
        if merged == current.replicas:
            return current
        return Placement(version=current.version + 1, replicas=merged)
    return Placement(version=0, replicas=new)
