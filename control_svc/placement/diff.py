"""What changes between two placements: the copies each server must load (prepare) and drop (release)."""
from __future__ import annotations

from dataclasses import dataclass

from control_svc.placement.types import Placement


def _copies(p: Placement) -> set[tuple[str, int, int]]:
    return {(s, layer, e) for layer, experts in p.replicas.items() for e, copies in enumerate(experts) for s in copies}


def _group(items: set[tuple[str, int, int]]) -> dict[str, dict[int, tuple[int, ...]]]:
    out: dict[str, dict[int, list[int]]] = {}
    for s, layer, e in items:
        out.setdefault(s, {}).setdefault(layer, []).append(e)
    return {s: {l: tuple(sorted(es)) for l, es in sorted(ls.items())} for s, ls in sorted(out.items())}


@dataclass(frozen=True)
class PlacementDiff:
    """`loads[server][layer]` = experts the server must load; `drops` likewise for experts it releases."""

    loads: dict[str, dict[int, tuple[int, ...]]]
    drops: dict[str, dict[int, tuple[int, ...]]]

    @property
    def moves(self) -> int:
        """Number of expert copies to load (the cost of a switch: each is read from the checkpoint)."""
        return sum(len(es) for layers in self.loads.values() for es in layers.values())

    @property
    def empty(self) -> bool:
        return not self.loads and not self.drops


def placement_diff(old: Placement | None, new: Placement) -> PlacementDiff:
    """Copies in `new` but not `old` (loads) and in `old` but not `new` (drops); `old=None` loads everything."""
    before = _copies(old) if old is not None else set()
    after = _copies(new)
    return PlacementDiff(loads=_group(after - before), drops=_group(before - after))
