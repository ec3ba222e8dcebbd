"""How evenly a placement spreads a load over servers.

Shape letters: L layers, E logical experts, S servers.
"""
from __future__ import annotations

from typing import Sequence

import torch

from control_svc.placement.budget import ServerBudget
from control_svc.placement.replicate import as_load
from control_svc.placement.types import Placement


def _ids(servers: Sequence[str | ServerBudget] | None, placement: Placement) -> list[str]:
    if servers is None:
        return list(placement.servers())
    return [s.server_id if isinstance(s, ServerBudget) else s for s in servers]


def server_loads(
    load, placement: Placement, servers: Sequence[str | ServerBudget] | None = None, layer_ids: Sequence[int] | None = None
) -> torch.Tensor:
    """Per-server load `[L,S]` (float64): each expert's load `load[L,E]` is shared evenly by its copies.

    Row l of `load` is placement layer `layer_ids[l]` (default `placement.layers`). `servers` fixes
    the columns (default `placement.servers()`); copies on servers outside it are ignored.
    """
    w = as_load(load)
    layers = list(placement.layers if layer_ids is None else layer_ids)
    if len(layers) != w.shape[0]:
        raise ValueError(f"load has {w.shape[0]} layers, placement/layer_ids name {len(layers)}")
    ids = _ids(servers, placement)
    col = {s: i for i, s in enumerate(ids)}
    out = torch.zeros(w.shape[0], len(ids), dtype=torch.float64)
    for row, layer in enumerate(layers):
        experts = placement.replicas.get(layer)
        if experts is None or len(experts) != w.shape[1]:
            raise ValueError(f"placement layer {layer} must list {w.shape[1]} experts")
        for e, copies in enumerate(experts):
            share = float(w[row, e]) / len(copies)
            for s in copies:
                if s in col:
                    out[row, col[s]] += share
    return out


def balancedness(
    load, placement: Placement, servers: Sequence[str | ServerBudget] | None = None, layer_ids: Sequence[int] | None = None
) -> float:
    """Mean over layers of (mean per-server load / max per-server load), in (0, 1]; 1 is perfect.

    Every MoE layer waits for its slowest server, so each layer is scored on its own. A layer with
    no load scores 1. Arguments as in `server_loads`.
    """
    per_server = server_loads(load, placement, servers, layer_ids)
    if per_server.shape[1] == 0:
        raise ValueError("servers must name at least one server")
    peak = per_server.max(dim=1).values
    ratio = torch.where(peak > 0, per_server.mean(dim=1) / peak.clamp_min(1e-300), torch.ones_like(peak))
    return float(ratio.mean())
