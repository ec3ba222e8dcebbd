"""Incremental placement of one layer: keep the current copies, add the missing ones, then change
one thing at a time around the busiest server while that lowers its load.

Shape letters: P copies (items) of the layer, E logical experts, S servers, m copies on the
busiest server, K copies of experts with more than one copy.
"""
from __future__ import annotations

import torch

from control_svc.placement.pack import LayerPacker

INF = float("inf")


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
