"""`Placement`: the versioned map every attention replica and expert server agrees on.

`replicas[layer][e]` is the tuple of expert-server ids holding a copy of logical expert `e` of MoE
layer `layer` (at least one each). Attention replicas spread an expert's rows over its copies.
"""
from __future__ import annotations

from dataclasses import dataclass, field

LayerExperts = dict[int, tuple[int, ...]]  # layer -> logical experts (ascending)


@dataclass(frozen=True)
class Placement:
    version: int
    replicas: dict[int, tuple[tuple[str, ...], ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.version < 0:
            raise ValueError(f"placement version must be >= 0, got {self.version}")
        for layer, experts in self.replicas.items():
            for e, servers in enumerate(experts):
                if not servers:
                    raise ValueError(f"placement v{self.version}: layer {layer} expert {e} has no server")

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.replicas))

    def servers(self) -> tuple[str, ...]:
        """Every server id that holds at least one expert, sorted."""
        return tuple(sorted({s for experts in self.replicas.values() for copies in experts for s in copies}))

    def experts_on(self, server: str) -> LayerExperts:
        """layer -> logical experts (ascending) that `server` holds."""
        out: LayerExperts = {}
        for layer, experts in self.replicas.items():
            held = tuple(e for e, copies in enumerate(experts) if server in copies)
            if held:
                out[layer] = held
        return out
