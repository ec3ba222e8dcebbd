"""`MoeKnobs`: top-k and capacity factor of the MoE layers, globally and per layer.

They change between engine steps without reloading weights. The engine starts from
`EngineConfig.moe_top_k` / `capacity_factor`; in the mesh the control plane carries them with each
placement version (`moemesh ctl set`), and attention replicas apply them to every MoE layer at once.
Unset (None) means the model's own value: its configured top-k, capacity factor 0 (dropless).
capacity_factor (the Tutel convention): > 0 caps each expert at ceil(k*cf*T/E) rows, overflow
dropped; 0 dropless; < 0 dropless up to ceil(k*|cf|*T/E) rows per expert.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence


@dataclass(frozen=True)
class LayerKnobs:
    """One MoE layer's settings (None: not set here)."""

    layer: int
    top_k: int | None = None
    capacity_factor: float | None = None


@dataclass(frozen=True)
class MoeKnobs:
    top_k: int | None = None
    capacity_factor: float | None = None
    layers: tuple[LayerKnobs, ...] = ()  # per-layer overrides, ascending layer

    def __post_init__(self) -> None:
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        check_capacity_factor(self.capacity_factor)
        for s in self.layers:
            if s.top_k is not None and s.top_k < 1:
                raise ValueError(f"top_k for layer {s.layer} must be >= 1, got {s.top_k}")
            check_capacity_factor(s.capacity_factor, f" for layer {s.layer}")
        ids = [s.layer for s in self.layers]
        if ids != sorted(set(ids)):
            raise ValueError(f"layers must be ascending, one entry per layer, got {ids}")

    def _override(self, layer: int) -> LayerKnobs:
        return next((s for s in self.layers if s.layer == layer), LayerKnobs(layer))

    def for_layer(self, layer: int) -> LayerKnobs:
        """What MoE layer `layer` runs with: top_k None = the model's; capacity_factor always a number."""
        if not self.layers:  # no per-layer overrides (the usual case; asked once per MoE layer per step)
            return LayerKnobs(layer, self.top_k, 0.0 if self.capacity_factor is None else self.capacity_factor)
        s = self._override(layer)
        top_k = s.top_k if s.top_k is not None else self.top_k
        cf = s.capacity_factor if s.capacity_factor is not None else self.capacity_factor
        return LayerKnobs(layer, top_k, 0.0 if cf is None else cf)

    def effective(self, layer: int, model_top_k: int) -> tuple[int, float]:
        """(top_k, capacity_factor) MoE layer `layer` runs with on a model whose top-k is `model_top_k`."""
        s = self.for_layer(layer)
        return (s.top_k if s.top_k is not None else model_top_k), s.capacity_factor

    def updated(self, top_k: int | None = None, capacity_factor: float | None = None, layer: int | None = None) -> "MoeKnobs":
        """A copy with the given values set for every layer (layer None; this clears the per-layer
        overrides of that field) or for one layer. ValueError names a bad field."""
        if layer is None:
            layers = (
                LayerKnobs(s.layer, None if top_k is not None else s.top_k, None if capacity_factor is not None else s.capacity_factor)
                for s in self.layers
            )
            return MoeKnobs(
                top_k if top_k is not None else self.top_k,
                capacity_factor if capacity_factor is not None else self.capacity_factor,
                tuple(s for s in layers if s.top_k is not None or s.capacity_factor is not None),
            )
        cur = self._override(layer)
        new = replace(
            cur,
            top_k=top_k if top_k is not None else cur.top_k,
            capacity_factor=capacity_factor if capacity_factor is not None else cur.capacity_factor,
        )
        return replace(self, layers=tuple(sorted([s for s in self.layers if s.layer != layer] + [new], key=lambda s: s.layer)))

    def describe(self) -> str:
        parts = [f"top_k={'model' if self.top_k is None else self.top_k}",
                 f"capacity_factor={'model' if self.capacity_factor is None else self.capacity_factor}"]
        parts += [f"layer {s.layer}: top_k={s.top_k}, capacity_factor={s.capacity_factor}" for s in self.layers]
        return "; ".join(parts)


def check_capacity_factor(cf: float | None, where: str = "") -> None:
    """ValueError naming the field unless `cf` is unset or finite (any sign: see the module doc)."""
    if cf is not None and not math.isfinite(cf):
        raise ValueError(f"capacity_factor{where} must be a finite number (>0 capacity, 0 dropless, <0 dropless up to |cf|), got {cf}")


def check_change(
    moe_layers: Sequence[int], num_experts: int, top_k: int | None = None, capacity_factor: float | None = None, layer: int | None = None
) -> None:
    """ValueError naming the field when `MoeKnobs.updated(top_k, capacity_factor, layer)` does not
    fit a model with these MoE layers and experts (or changes nothing)."""
    if top_k is not None and not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    check_capacity_factor(capacity_factor)
    if layer is not None and layer not in moe_layers:
        raise ValueError(f"layer {layer} is not a MoE layer (MoE layers: {list(moe_layers)})")
    if top_k is None and capacity_factor is None:
        raise ValueError("top_k or capacity_factor must be given")
