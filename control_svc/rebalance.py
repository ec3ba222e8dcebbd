"""Deciding a rebalance: observed load + budgets + the committed placement -> the next placement.

Shape letters: L MoE layers, E logical experts. Pure functions over the solver in
`control_svc/placement` (EPLB-style: replicas for the hottest experts, balanced packing within
each server's slots, minimal movement from the current placement).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from control_svc.placement import Placement, RebalancePolicy, ServerBudget, balancedness, placement_diff, solve


@dataclass(frozen=True)
class RebalancePlan:
    placement: Placement | None  # None: keep the current placement (`reason` says why)
    before: float  # balancedness of the current placement under the load
    after: float  # balancedness of the planned placement (== before when None)
    moves: int  # expert copies the switch loads
    tokens: int  # tokens in the load window
    reason: str = ""


def plan_rebalance(
    load: torch.Tensor,
    budgets: Sequence[ServerBudget],
    current: Placement,
    layers: Sequence[int],
    policy: RebalancePolicy,
    num_physical: int | None = None,
    force: bool = False,
    prior: int = 0,
) -> RebalancePlan:
    """load [L, E] (rows = `layers`); the solver sees `load + prior` (a prior of a few tokens per
    expert spreads experts even where nothing was observed). Unforced, a plan needs `policy.min_tokens` tokens, a
    balancedness gain of `policy.min_gain` and at most `policy.max_moves` moves (0 = any); forced,
    any change the solver finds is planned. A current placement naming servers outside `budgets`
    (dead or leaving) is always re-solved."""
    ids = [b.server_id for b in budgets]
    tokens = int(load.sum())
    load = load + prior
    before = balancedness(load, current, ids, layers)
    lost = [s for s in current.servers() if s not in ids]
    if not force and not lost and tokens < policy.min_tokens:
        return RebalancePlan(None, before, before, 0, tokens, f"{tokens} tokens in the load window, fewer than min_tokens {policy.min_tokens}")
    new = solve(load, budgets, num_physical, current, layer_ids=list(layers), tolerance=policy.tolerance)
    if new is current:
        return RebalancePlan(None, before, before, 0, tokens, "the solver keeps the current placement")
    after = balancedness(load, new, ids, layers)
    moves = placement_diff(current, new).moves
    if not force and not lost:
        if after - before < policy.min_gain:
            return RebalancePlan(None, before, after, moves, tokens, f"balancedness gain {after - before:.3f} is below min_gain {policy.min_gain}")
        if policy.max_moves and moves > policy.max_moves:
            return RebalancePlan(None, before, after, moves, tokens, f"{moves} moves exceed max_moves {policy.max_moves}")
    return RebalancePlan(new, before, after, moves, tokens)
