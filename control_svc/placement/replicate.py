"""Replication: how many physical copies each logical expert gets (EPLB's greedy step).

Shape letters: L layers, E logical experts, P physical slots (copies) per layer, S servers.
"""
from __future__ import annotations

from typing import Sequence

import torch


def as_load(load, name: str = "load") -> torch.Tensor:
    """Validate a load table and return it as float64 `[L,E]` (a 1-D `[E]` becomes `[1,E]`)."""
    t = torch.as_tensor(load, dtype=torch.float64)
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2:
        raise ValueError(f"{name} must have shape [L,E] or [E], got {tuple(t.shape)}")
    if t.shape[1] == 0:
        raise ValueError(f"{name} must have at least one expert, got shape {tuple(t.shape)}")
    if not torch.isfinite(t).all() or (t < 0).any():
        raise ValueError(f"{name} must be finite and >= 0")
    return t


def slot_capacity(server_slots: Sequence[int], num_experts: int) -> torch.Tensor:
    """cap[k-1] = sum_s min(slots_s, k) for k = 1..E: the most copies any k experts can have
    when no server holds two copies of one expert. Shape `[E]`."""
    b = torch.as_tensor(list(server_slots), dtype=torch.int64).reshape(1, -1)
    k = torch.arange(1, num_experts + 1, dtype=torch.int64).reshape(-1, 1)
    return torch.minimum(b, k).sum(dim=1)


def copies_fit(logcnt: torch.Tensor, capacity: torch.Tensor) -> bool:
    """Whether copy counts `logcnt[E]` can be placed one copy per server (Gale-Ryser condition:
    the k most copied experts never need more than `capacity[k-1]` copies)."""
    top = torch.sort(logcnt, descending=True).values.cumsum(0)
    return bool((top <= capacity).all())


def replicate(
    load, num_physical: int, server_slots: Sequence[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give each logical expert one copy, then each further copy to the expert with the highest load per copy.

    load: `[L,E]` (or `[E]`) token counts, >= 0.  num_physical: P >= E copies per layer.
    server_slots: when given (one per-layer budget per server), a copy is only added if the copy
    counts can still be placed without two copies of one expert on a server; the hottest expert
    that still fits gets it. Ties go to the lower expert index.

    Returns `(phy2log[L,P], rank[L,P], logcnt[L,E])` as int64 (1-D inputs give `[P]`, `[P]`, `[E]`):
    physical slot p holds copy `rank[p]` of logical expert `phy2log[p]`; slots are grouped by
    expert in ascending order; `logcnt[e]` is the number of copies of expert `e`.
    """
    one_d = torch.as_tensor(load).dim() == 1
    w = as_load(load)
    num_layers, num_experts = w.shape
    if isinstance(num_physical, bool) or not isinstance(num_physical, int) or num_physical < num_experts:
        raise ValueError(f"num_physical must be an int >= the {num_experts} logical experts, got {num_physical!r}")
    logcnt = torch.ones(num_layers, num_experts, dtype=torch.int64)
    extra = num_physical - num_experts
    if server_slots is None:
        rows = torch.arange(num_layers)
        for _ in range(extra):
            logcnt[rows, torch.argmax(w / logcnt, dim=1)] += 1
    else:
        capacity = slot_capacity(server_slots, num_experts)
        if not copies_fit(logcnt[0], capacity) or num_physical > int(capacity[-1]):
            raise ValueError(
                f"num_physical: server_slots {list(server_slots)} hold at most {int(capacity[-1])} copies of "
                f"{num_experts} experts (one copy per server), asked for {num_physical}"
            )
        for layer in range(num_layers):
            cnt = logcnt[layer]
            for _ in range(extra):
                order = torch.sort(w[layer] / cnt, descending=True, stable=True).indices
                for e in order.tolist():
                    cnt[e] += 1
                    if copies_fit(cnt, capacity):
                        break
                    cnt[e] -= 1
                else:
                    raise ValueError(f"num_physical: no expert of layer {layer} can take another copy within server_slots")
    phy2log = torch.stack([torch.repeat_interleave(torch.arange(num_experts), c) for c in logcnt])
    offsets = logcnt.cumsum(dim=1) - logcnt
    rank = torch.arange(num_physical).expand(num_layers, -1) - offsets.gather(1, phy2log)
    if one_d:
        return phy2log[0], rank[0], logcnt[0]
    return phy2log, rank, logcnt
