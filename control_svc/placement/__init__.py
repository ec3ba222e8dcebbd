"""Expert placement: the versioned map of (layer, logical expert) -> expert servers, and its solver.

Pure functions (no I/O): `initial_placement` before any load is known, `solve` from observed load
(see `solver.py` for the minimal-movement rules), `balancedness`/`server_loads` to score a
placement, `placement_diff` for the copies a switch loads and drops, `propose` +
`RebalancePolicy` for when a rebalance is worth it. `ServerBudget.from_total` turns an expert
server's total `--slot-budget` into the per-layer budget the solver uses.
"""
from control_svc.placement.balance import balancedness, server_loads
from control_svc.placement.budget import ServerBudget
from control_svc.placement.diff import PlacementDiff, placement_diff
from control_svc.placement.initial import initial_placement
from control_svc.placement.pack import pack
from control_svc.placement.policy import RebalancePolicy, propose
from control_svc.placement.replicate import replicate
from control_svc.placement.solver import solve
from control_svc.placement.types import Placement

__all__ = [
    "Placement", "PlacementDiff", "RebalancePolicy", "ServerBudget", "balancedness", "initial_placement",
    "pack", "placement_diff", "propose", "replicate", "server_loads", "solve",
]
