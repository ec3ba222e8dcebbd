"""Balanced packing of weighted items (expert copies) onto servers with per-server slot budgets.

Shape letters: L layers, N items per layer, G groups (logical experts), S servers.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

import torch


def _slots_tensor(slots: int | Sequence[int], num_servers: int) -> torch.Tensor:
    if isinstance(num_servers, bool) or not isinstance(num_servers, int) or num_servers < 1:
        raise ValueError(f"num_servers must be an int >= 1, got {num_servers!r}")
    if isinstance(slots, int) and not isinstance(slots, bool):
        b = torch.full((num_servers,), slots, dtype=torch.int64)
    else:
        b = torch.as_tensor(list(slots), dtype=torch.int64)
        if b.shape != (num_servers,):
            raise ValueError(f"slots must be an int or one budget per server ({num_servers}), got {list(slots)}")
    if (b < 0).any():
        raise ValueError(f"slots must be >= 0, got {b.tolist()}")
    return b


class LayerPacker:
    """Mutable state of one layer's packing (local to one `pack` call)."""

    def __init__(self, slots: torch.Tensor, num_groups: int, num_items: int) -> None:
        self.load = torch.zeros(len(slots), dtype=torch.float64)
        self.free = slots.clone()
        self.on = torch.zeros(num_groups, len(slots), dtype=torch.bool)  # group g has a copy on server s
        self.items_on: list[list[int]] = [[] for _ in range(len(slots))]
        self.server = torch.full((num_items,), -1, dtype=torch.int64)

    def place(self, item: int, group: int, weight: float, s: int) -> None:
        self.server[item] = s
        self.load[s] += weight
        self.free[s] -= 1
        self.on[group, s] = True
        self.items_on[s].append(item)

    def remove(self, item: int, group: int, weight: float) -> int:
        s = int(self.server[item])
        self.load[s] -= weight
        self.free[s] += 1
        self.on[group, s] = False
        self.items_on[s].remove(item)
        return s

    def augment(self, item: int, groups: list[int], weights: list[float]) -> None:
        """Place `item` when every server with a free slot already holds its group: find a chain
        item -> full server s1, evict j1 -> s2, evict j2 -> ... -> a server with a free slot
        (an augmenting path of the bipartite b-matching; it exists whenever a placement exists)."""
        g = groups[item]
        parent: dict[int, tuple[int, int]] = {}  # server -> (item moving onto it, server it leaves or -1)
        queue: deque[int] = deque()
        for s in range(len(self.free)):
            if not self.on[g, s]:
                parent[s] = (item, -1)
                queue.append(s)
        while queue:
            s = queue.popleft()
            if self.free[s] > 0:
                moves = []
                while s != -1:
                    j, src = parent[s]
                    moves.append((j, s))
                    s = src
                for j, dst in moves:  # evictions first: each server's slot frees before it is refilled
                    if self.server[j] >= 0:
                        self.remove(j, groups[j], weights[j])
                for j, dst in moves:
                    self.place(j, groups[j], weights[j], dst)
                return
            for j in self.items_on[s]:
                h = groups[j]
                for u in range(len(self.free)):
                    if u not in parent and not self.on[h, u]:
                        parent[u] = (j, s)
                        queue.append(u)
        raise ValueError(
            f"slots: the server budgets {self.free.tolist()} (free) cannot take another copy of expert {g} "
            "without two copies of one expert on a server"
        )


def pack(
    weights,
    num_servers: int,
    slots: int | Sequence[int],
    *,
    groups=None,
    held=None,
    tolerance: float = 0.0,
) -> torch.Tensor:
    """Assign items to servers, heaviest first, each onto the least-loaded server with a free slot.

    weights: `[L,N]` (or `[N]`) item weights >= 0.  num_servers: S.  slots: per-server budget per
    layer, one int for all servers or `S` ints.  groups: `[L,N]` int64 group (logical expert) of each
    item, default every item its own group; two items of one group never share a server.
    held: `[L,G,S]` bool, servers that already hold a copy of group g (from the current placement).
    tolerance: stickiness. A copy goes to the least-loaded held server instead of the least-loaded
    server overall when its load is at most `tolerance * mean server load` above that server's
    (so 0 keeps a copy in place only on an exact tie).

    Returns `assignment[L,N]` (or `[N]`) int64: the server index of each item.
    Raises ValueError naming `slots` when the budgets cannot hold every item.
    """
    w = torch.as_tensor(weights, dtype=torch.float64)
    one_d = w.dim() == 1
    if one_d:
        w = w.unsqueeze(0)
    if w.dim() != 2 or not torch.isfinite(w).all() or (w < 0).any():
        raise ValueError(f"weights must be a finite, >= 0 tensor of shape [L,N] or [N], got shape {tuple(w.shape)}")
    num_layers, num_items = w.shape
    b = _slots_tensor(slots, num_servers)
    if groups is None:
        grp = torch.arange(num_items).expand(num_layers, -1)
    else:
        grp = torch.as_tensor(groups, dtype=torch.int64).reshape(num_layers, num_items)
        if (grp < 0).any():
            raise ValueError("groups must be >= 0")
    num_groups = int(grp.max()) + 1 if num_items else 0
    if held is not None:
        held = torch.as_tensor(held, dtype=torch.bool)
        if held.dim() != 3 or held.shape[0] != num_layers or held.shape[1] < num_groups or held.shape[2] != num_servers:
            raise ValueError(f"held must have shape [L={num_layers}, G>={num_groups}, S={num_servers}], got {tuple(held.shape)}")
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance!r}")
    if num_items > int(b.sum()):
        raise ValueError(f"slots: {num_items} items per layer do not fit in {int(b.sum())} slots {b.tolist()}")
    out = torch.empty(num_layers, num_items, dtype=torch.int64)
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    for layer in range(num_layers):
        st = LayerPacker(b, num_groups, num_items)
        wl, gl = w[layer].tolist(), grp[layer].tolist()
        slack = tolerance * float(w[layer].sum()) / num_servers
        for i in torch.sort(w[layer], descending=True, stable=True).indices.tolist():
            g = gl[i]
            cand = (st.free > 0) & ~st.on[g]
            if not cand.any():
                st.augment(i, gl, wl)
                continue
            best = int(torch.argmin(torch.where(cand, st.load, inf)))
            if held is not None:
                sticky = cand & held[layer, g]
                if sticky.any():
                    keep = int(torch.argmin(torch.where(sticky, st.load, inf)))
                    if st.load[keep] <= st.load[best] + slack:
                        best = keep
            st.place(i, g, wl[i], best)
        out[layer] = st.server
    return out[0] if one_d else out
