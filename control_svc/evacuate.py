"""Moving a leaving server's experts elsewhere: a pure function on placements.

A copy whose expert has other replicas is simply dropped; a sole copy moves to the serving server
with the fewest copies that has a free slot and does not hold that expert yet.
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

from control_svc.placement.types import Placement


def evacuate(p: Placement, leaving: str, servers: Sequence[tuple[str, int]], version: int) -> Placement:
    """servers: (id, slot budget; 0 = no limit) that may take copies (`leaving` is ignored there).
    Returns placement `version` without `leaving`; ValueError when the others lack the slots."""
    targets = [(sid, budget) for sid, budget in servers if sid != leaving]
    load = Counter({sid: 0 for sid, _ in targets})
    for experts in p.replicas.values():
        for copies in experts:
            load.update(s for s in copies if s in load)
    budget = dict(targets)
    replicas: dict[int, tuple[tuple[str, ...], ...]] = {}
    for layer in p.layers:
        out = []
        for e, copies in enumerate(p.replicas[layer]):
            rest = tuple(s for s in copies if s != leaving)
            if not rest:
                free = [s for s, _ in targets if (budget[s] == 0 or load[s] < budget[s]) and s not in copies]
                if not free:
                    raise ValueError(f"slot_budget: no server has a free slot for layer {layer} expert {e} of leaving server {leaving}")
                target = min(free, key=lambda s: (load[s], s))
                load[target] += 1
                rest = (target,)
            out.append(rest)
        replicas[layer] = tuple(out)
    return Placement(version=version, replicas=replicas)
