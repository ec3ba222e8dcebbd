"""Rebuilding the placement after a control plane restart, from what the expert servers hold.

A restarted control plane knows no placement, while the expert servers still hold the experts of the
last one and the attention replicas still run it. The servers re-register with the experts they
hold; `rebuild_placement` turns those reports into the placement to commit: every copy a server
holds stays where it is (nothing is loaded or dropped for it), and an expert no server holds (its
servers did not come back) gets one copy on the server with the fewest copies that has a free slot.
The control plane numbers the result above every version anyone reported, so the replicas adopt it.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

from moemesh.contracts.knobs import MoeKnobs
from moemesh.contracts.placement import LayerExperts, Placement


def check_held(held: LayerExperts, layers: Sequence[int], num_experts: int) -> None:
    """ValueError naming `held` unless every entry is a MoE layer of the model and an expert id in range."""
    for layer, experts in held.items():
        if layer not in layers:
            raise ValueError(f"held: layer {layer} is not a MoE layer of the model (MoE layers: {list(layers)})")
        bad = [e for e in experts if not 0 <= e < num_experts]
        if bad:
            raise ValueError(f"held: layer {layer} experts {bad} are out of range [0, {num_experts})")


def rebuild_placement(
    layers: Sequence[int], num_experts: int, held: Mapping[str, LayerExperts], budgets: Mapping[str, int], version: int,
) -> Placement:
    """Placement `version` from the experts each server holds.

    held: server id -> layer -> experts it holds; budgets: server id -> total slot budget (0 = no
    limit) of every server that may hold copies (reports of other servers are ignored). A copy
    nobody holds goes to the server with a free slot that has the fewest copies in that layer, then
    in all (then the lowest id). ValueError when no server has a free slot for one."""
    if not budgets:
        raise ValueError("servers: at least one expert server is needed to place experts")
    if num_experts <= 0 or not layers:
        raise ValueError(f"nothing to place: layers {list(layers)}, num_experts {num_experts}")
    servers = sorted(budgets)
    for sid in servers:
        check_held(held.get(sid, {}), layers, num_experts)
    holders = {(layer, e): sorted(s for s in servers if e in held.get(s, {}).get(layer, ())) for layer in layers for e in range(num_experts)}
    used = Counter({s: sum(len(set(es)) for layer, es in held.get(s, {}).items()) for s in servers})
    replicas: dict[int, tuple[tuple[str, ...], ...]] = {}
    for layer in layers:
        in_layer = Counter(s for e in range(num_experts) for s in holders[(layer, e)])
        row = []
        for e in range(num_experts):
            copies = holders[(layer, e)]
            if not copies:
                free = [s for s in servers if budgets[s] == 0 or used[s] < budgets[s]]
                if not free:
                    raise ValueError(f"slot_budget: no server has a free slot for layer {layer} expert {e}, which no server holds")
                target = min(free, key=lambda s: (in_layer[s], used[s], s))
                used[target] += 1
                in_layer[target] += 1
                copies = [target]
            row.append(tuple(copies))
        replicas[layer] = tuple(row)
    return Placement(version=version, replicas=replicas)


@dataclass
class RestartMemory:
    """What a control plane learns of the placements before its restart, from the versions and knobs
    servers and replicas report. Decisions only: the plane commits what they ask for.

    floor: the newest placement version anyone reported; restarted: one was reported before this
    plane committed any placement (so its first placement is rebuilt from what servers hold, and its
    own version numbers may repeat the old plane's); inherited: (version, knobs) of the newest
    placement a replica reports running; knobs_set: knobs were set on this plane (they win)."""

    floor: int = 0
    restarted: bool = False
    inherited: tuple[int, MoeKnobs] | None = None
    knobs_set: bool = False

    def note_version(self, version: int, committed: int, at_least: bool = False) -> bool:
        """A server or replica has seen placement `version`; `committed`: this plane's committed
        version (0: none yet). True when the committed placement must be renumbered above the floor
        so that replicas adopt it: a version above it was reported, or (`at_least`: a registering
        replica) one equal to it on a restarted plane, which may have been the old plane's."""
        if version <= 0:
            return False
        self.floor = max(self.floor, version)
        if committed == 0:
            self.restarted = True
            return False
        return version > committed or (at_least and self.restarted and version == committed)

    def inherit(self, version: int, knobs: MoeKnobs, committed: int, current: MoeKnobs) -> bool:
        """A replica reports running `knobs` with placement `version`. A restarted plane on which no
        knobs were set keeps the newest; True when they must be committed now (a placement exists and
        its knobs differ)."""
        if not self.restarted or self.knobs_set:
            return False
        if self.inherited is None or version > self.inherited[0]:
            self.inherited = (version, knobs)
        return committed > 0 and current != self.inherited[1]

    def inherited_knobs(self) -> MoeKnobs | None:
        """The knobs to run after the restart, unless knobs were set on this plane."""
        return None if self.knobs_set or self.inherited is None else self.inherited[1]
