"""`MoeKnobs`: routing settings that may change between engine steps without reloading weights."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping


@dataclass(frozen=True)
class LayerKnobs:
    """Effective settings for one MoE layer. top_k None = the model's configured top-k."""

    top_k: int | None = None
    capacity_factor: float = 0.0


@dataclass(frozen=True)
class MoeKnobs:
    """Global defaults plus per-layer overrides.

    capacity_factor (the Tutel convention): > 0 pads/caps each expert at ceil(k*cf*T/E) rows, overflow
    dropped; 0 dropless; < 0 dropless up to ceil(k*|cf|*T/E) rows per expert.
    """

    top_k: int | None = None
    capacity_factor: float = 0.0
    per_layer: Mapping[int, LayerKnobs] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        for layer, k in self.per_layer.items():
            if k.top_k is not None and k.top_k < 1:
                raise ValueError(f"top_k for layer {layer} must be >= 1, got {k.top_k}")

    def for_layer(self, layer: int) -> LayerKnobs:
        return self.per_layer.get(layer, LayerKnobs(self.top_k, self.capacity_factor))

    def updated(self, top_k: int | None = None, capacity_factor: float | None = None, layer: int | None = None) -> "MoeKnobs":
        """A copy with `top_k` / `capacity_factor` changed globally, or for one layer when `layer` is given."""
        if layer is None:
            return replace(
                self,
                top_k=self.top_k if top_k is None else top_k,
                capacity_factor=self.capacity_factor if capacity_factor is None else capacity_factor,
            )
        cur = self.for_layer(layer)
        new = LayerKnobs(
            cur.top_k if top_k is None else top_k, cur.capacity_factor if capacity_factor is None else capacity_factor
        )
        per_layer = dict(self.per_layer)
        per_layer[layer] = new
        return replace(self, per_layer=MappingProxyType(per_layer))
