"""How copies of experts are counted and laid onto servers: the mechanics under `placement.solve`.

- `replicate`: how many copies each logical expert gets (EPLB's greedy step: each extra copy to the
  expert with the highest load per copy), within what the servers can hold;
- `pack`: copies onto servers, heaviest first onto the least-loaded server with a free slot, two
  copies of one expert never on one server, optionally sticking to servers that hold them now;
- `incremental`: from the current copies, one move, swap or re-replication at a time around the
  busiest server while that lowers its load (the minimal-movement path).

Shape letters: L layers, E logical experts, P copies (physical slots) per layer, N items per layer,
G groups (logical experts), S servers, m copies on the busiest server, K copies of experts with
more than one copy.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

import torch

INF = float("inf")


# ---- replication ----------------------------------------------------------------------------
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


# ---- packing -------------------------------------------------------------------------------
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
    inf = torch.tensor(INF, dtype=torch.float64)
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


# ---- incremental refinement ------------------------------------------------------------------
def _state(expert_load: torch.Tensor, groups: torch.Tensor, assign: torch.Tensor, slots: torch.Tensor):
    """count[E], weight[P] (expert load shared by its copies), load[S], free[S], on[E,S]."""
    num_experts, num_servers = len(expert_load), len(slots)
    count = torch.bincount(groups, minlength=num_experts)
    weight = expert_load[groups] / count[groups]
    load = torch.zeros(num_servers, dtype=torch.float64).index_add_(0, assign, weight)
    free = slots - torch.bincount(assign, minlength=num_servers)
    on = torch.zeros(num_experts, num_servers, dtype=torch.bool)
    on[groups, assign] = True
    return count, weight, load, free, on


def _best_step(
    expert_load: torch.Tensor, groups: torch.Tensor, assign: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The change around the busiest server s that leaves the servers it touches least loaded:

    - move: a copy on s goes to a server with a free slot;
    - swap: a copy on s trades places with a lighter copy elsewhere;
    - re-replicate: a copy of expert B (B has >= 2 copies) on server t becomes a copy of an
      expert A held by s; A's copies get lighter (s among them), B's heavier.

    Every server a change touches must end below s's load now; ties prefer a move, then a
    re-replication (one copy loaded each), then a swap (two). Returns the new (groups[P],
    assignment[P]) or None when nothing helps. Vectorised over `[m,S]`, `[m,P]` and `[m,K,S]`
    (K: copies of experts that have more than one).
    """
    count, w, load, free, on = _state(expert_load, groups, assign, slots)
    s = int(torch.argmax(load))
    peak = float(load[s])
    mine = torch.nonzero(assign == s).reshape(-1)
    if len(mine) == 0:
        return None
    wj, gj = w[mine], groups[mine]

    ok = ~on[gj] & (free > 0).unsqueeze(0)
    ok[:, s] = False
    move = torch.where(ok, torch.maximum(peak - wj[:, None], load[None, :] + wj[:, None]), INF)

    ok = (assign != s)[None, :] & (w[None, :] < wj[:, None]) & ~on[groups, s][None, :] & ~on[gj[:, None], assign[None, :]]
    swap = torch.where(ok, torch.maximum(peak - wj[:, None] + w[None, :], load[assign][None, :] + wj[:, None] - w[None, :]), INF)

    # re-replication, over the K copies whose expert has >= 2 copies (the only ones that can give one up)
    donors = torch.nonzero(count[groups] >= 2).reshape(-1)  # [K]
    rerep = torch.full((len(mine), len(donors)), INF, dtype=torch.float64)
    if len(donors):
        gk, t = groups[donors], assign[donors]
        la, ca = expert_load[gj], count[gj].double()  # [m]
        lb, cb = expert_load[gk], count[gk].double()  # [K]
        d_a = la / ca - la / (ca + 1)  # each copy of A gets this much lighter
        d_b = lb / (cb - 1) - lb / cb  # each remaining copy of B this much heavier
        on_a, on_b = on[gj].double(), on[gk].double()  # [m,S], [K,S]
        new = load[None, None, :] - d_a[:, None, None] * on_a[:, None, :] + d_b[None, :, None] * on_b[None, :, :]
        at_t = torch.nn.functional.one_hot(t, len(slots)).bool()[None, :, :]  # [1,K,S]
        new = torch.where(at_t, new - (lb / cb + d_b)[None, :, None] + (la / (ca + 1))[:, None, None], new)
        touched = on[gj][:, None, :] | on[gk][None, :, :] | at_t
        cost = torch.where(touched, new, -INF).amax(dim=2)  # [m,K]
        ok = (gj[:, None] != gk[None, :]) & ~on[gj[:, None], t[None, :]]
        rerep = torch.where(ok, cost, INF)

    best_move, best_rerep, best_swap = (float(x.min()) if x.numel() else INF for x in (move, rerep, swap))
    best = min(best_move, best_rerep, best_swap)
    if best >= peak - 1e-12 * max(1.0, peak):
        return None
    groups, assign = groups.clone(), assign.clone()
    if best_move == best:
        j, dst = divmod(int(torch.argmin(move)), move.shape[1])
        assign[mine[j]] = dst
    elif best_rerep == best:
        j, k = divmod(int(torch.argmin(rerep)), rerep.shape[1])
        groups[donors[k]] = gj[j]
    else:
        j, k = divmod(int(torch.argmin(swap)), swap.shape[1])
        assign[mine[j]], assign[k] = assign[k].clone(), s
    return groups, assign


def incremental(
    expert_load: torch.Tensor, groups: torch.Tensor, held: torch.Tensor, slots: torch.Tensor, max_steps: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Snapshots of one layer's placement, from "current copies kept" to a local optimum.

    expert_load `[E]`, groups `[P]` (logical expert of each copy, from `replicate`), held `[E,S]`
    bool (servers holding a copy now), slots `[S]`. Copies whose expert is still on a held server
    with room stay there; the rest go heaviest first to the least-loaded server that can take
    them; then up to `max_steps` steps of `_best_step` (which may also change how many copies an
    expert has). Returns `(groups[P], assignment[P])` after the repair and after every step.
    """
    expert_load = expert_load.to(torch.float64)
    count = torch.bincount(groups, minlength=len(expert_load))
    weights = expert_load[groups] / count[groups]
    wl, gl = weights.tolist(), groups.tolist()
    st = LayerPacker(slots, held.shape[0], len(groups))
    rest = []
    for i in torch.sort(weights, descending=True, stable=True).indices.tolist():
        keep = held[gl[i]] & (st.free > 0) & ~st.on[gl[i]]
        if keep.any():
            st.place(i, gl[i], wl[i], int(torch.nonzero(keep)[0]))
        else:
            rest.append(i)
    for i in rest:
        cand = (st.free > 0) & ~st.on[gl[i]]
        if cand.any():
            st.place(i, gl[i], wl[i], int(torch.argmin(torch.where(cand, st.load, INF))))
        else:
            st.augment(i, gl, wl)
    state = (groups.clone(), st.server.clone())
    snapshots = [state]
    for _ in range(max_steps):
        step = _best_step(expert_load, state[0], state[1], slots)
        if step is None:
            break
        state = step
        snapshots.append(state)
    return snapshots
