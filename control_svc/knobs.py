"""`RoutingKnobs`: top-k and capacity factor, globally and per MoE layer, as a placement version carries them.

Unset (None) means the model's own value: its configured top-k, capacity factor 0 (dropless).
Attention replicas turn them into `LLMEngine.set_moe_knobs` calls for every MoE layer at once.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence


@dataclass(frozen=True)
class LayerKnobSetting:
    layer: int
    top_k: int | None = None
    capacity_factor: float | None = None


@dataclass(frozen=True)
class RoutingKnobs:
    top_k: int | None = None
    capacity_factor: float | None = None
    layers: tuple[LayerKnobSetting, ...] = ()  # per-layer overrides, ascending layer

    def updated(
        self,
        moe_layers: Sequence[int],
        num_experts: int,
        top_k: int | None = None,
        capacity_factor: float | None = None,
        layer: int | None = None,
    ) -> "RoutingKnobs":
        """A copy with the given values set for every layer (layer None; this clears per-layer
        overrides of that field) or for one MoE layer. ValueError names the bad field."""
        if top_k is not None and not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        if capacity_factor is not None and capacity_factor != capacity_factor:
            raise ValueError("capacity_factor must be a number, got NaN")
        if layer is not None and layer not in moe_layers:
            raise ValueError(f"layer {layer} is not a MoE layer (MoE layers: {list(moe_layers)})")
        if top_k is None and capacity_factor is None:
            raise ValueError("top_k or capacity_factor must be given")
        if layer is None:
            layers = tuple(
                LayerKnobSetting(
                    s.layer, None if top_k is not None else s.top_k, None if capacity_factor is not None else s.capacity_factor
                )
                for s in self.layers
            )
            return RoutingKnobs(
                top_k if top_k is not None else self.top_k,
                capacity_factor if capacity_factor is not None else self.capacity_factor,
                tuple(s for s in layers if s.top_k is not None or s.capacity_factor is not None),
            )
        cur = next((s for s in self.layers if s.layer == layer), LayerKnobSetting(layer))
        new = replace(
            cur,
            top_k=top_k if top_k is not None else cur.top_k,
            capacity_factor=capacity_factor if capacity_factor is not None else cur.capacity_factor,
        )
        return replace(self, layers=tuple(sorted([s for s in self.layers if s.layer != layer] + [new], key=lambda s: s.layer)))

    def effective(self, layer: int, model_top_k: int) -> tuple[int, float]:
        """(top_k, capacity_factor) MoE layer `layer` runs with."""
        s = next((s for s in self.layers if s.layer == layer), LayerKnobSetting(layer))
        top_k = s.top_k if s.top_k is not None else self.top_k if self.top_k is not None else model_top_k
        cf = s.capacity_factor if s.capacity_factor is not None else self.capacity_factor if self.capacity_factor is not None else 0.0
        return top_k, cf

    def describe(self) -> str:
        parts = [f"top_k={'model' if self.top_k is None else self.top_k}",
                 f"capacity_factor={'model' if self.capacity_factor is None else self.capacity_factor}"]
        parts += [f"layer {s.layer}: top_k={s.top_k}, capacity_factor={s.capacity_factor}" for s in self.layers]
        return "; ".join(parts)
