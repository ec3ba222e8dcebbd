"""When to rebalance: a pure decision over observed load, so the control plane's loop stays a few lines.

Shape letters: L layers, E logical experts.

    policy = RebalancePolicy(min_gain=0.05, min_tokens=50_000)
    new = propose(counter.window(), budgets, current, policy)   # None: keep `current`
    if new is not None: start the live switch to `new`
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from control_svc.placement.balance import balancedness
from control_svc.placement.budget import ServerBudget
from control_svc.placement.diff import placement_diff
from control_svc.placement.replicate import as_load
from control_svc.placement.solver import solve
from control_svc.placement.types import Placement


@dataclass(frozen=True)
class RebalancePolicy:
    """min_gain: the balancedness a switch must gain (absolute, 0..1) to be worth its moves.
    min_tokens: fewer tokens than this in the window is noise: no decision.
    max_moves: most expert copies one switch may load (0 = no limit); above it, no switch.
    tolerance: passed to `solve` (balance traded for fewer moves)."""

    min_gain: float = 0.05
    min_tokens: int = 10_000
    max_moves: int = 0
    tolerance: float = 0.05

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_gain <= 1.0:
            raise ValueError(f"min_gain must be in [0, 1], got {self.min_gain!r}")
        for name in ("min_tokens", "max_moves"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not self.tolerance >= 0:
            raise ValueError(f"tolerance must be >= 0, got {self.tolerance!r}")


def propose(
    load,
    servers: Sequence[ServerBudget],
    current: Placement,
    policy: RebalancePolicy = RebalancePolicy(),
    *,
    layer_ids: Sequence[int] | None = None,
    num_physical: int | None = None,
) -> Placement | None:
    """The placement to switch to, or None to keep `current`.

    load: `[L,E]` tokens per (layer, expert) over the recent window (rows = `layer_ids`, default
    `current.layers`). A switch is proposed when the window holds at least `min_tokens`, the
    solved placement's balancedness beats the current one's by `min_gain`, and it loads at most
    `max_moves` copies. A current placement naming servers that are gone is always re-solved
    (its experts must find a home), whatever the gain.
    """
    w = as_load(load)
    layers = list(current.layers if layer_ids is None else layer_ids)
    ids = {s.server_id for s in servers}
    lost = [s for s in current.servers() if s not in ids]
    if not lost and float(w.sum()) < policy.min_tokens:
        return None
    new = solve(w, servers, num_physical, current, layer_ids=layers, tolerance=policy.tolerance)
    if new is current:
        return None
    if lost:
        return new
    gain = balancedness(w, new, servers, layers) - balancedness(w, current, servers, layers)
    if gain < policy.min_gain:
        return None
    if policy.max_moves and placement_diff(current, new).moves > policy.max_moves:
        return None
    return new
