"""Incremental placement of one layer: keep the current copies, add the missing ones, then move
copies off the busiest server one at a time while that lowers its load.

Shape letters: P copies (items) of the layer, E logical experts, S servers.
"""
from __future__ import annotations

import torch

from control_svc.placement.pack import LayerPacker


def _best_step(st: LayerPacker, groups: list[int], weights: list[float]) -> tuple[float, list[tuple[int, int]]] | None:
    """The move or swap off the busiest server that leaves the pair's larger load lowest.
    Returns (that load, [(item, destination server), ...]) or None when nothing lowers it."""
    s = int(torch.argmax(st.load))
    peak = float(st.load[s])
    best: tuple[float, list[tuple[int, int]]] | None = None
    for j in st.items_on[s]:
        gj, wj = groups[j], weights[j]
        for t in range(len(st.free)):
            if t == s or st.on[gj, t]:
                continue
            lt = float(st.load[t])
            if st.free[t] > 0:
                cost = max(peak - wj, lt + wj)
                if cost < peak - 1e-12 and (best is None or cost < best[0]):
                    best = (cost, [(j, t)])
            for k in st.items_on[t]:
                gk, wk = groups[k], weights[k]
                if wk >= wj or st.on[gk, s]:
                    continue
                cost = max(peak - wj + wk, lt + wj - wk)
                if cost < peak - 1e-12 and (best is None or cost < best[0]):
                    best = (cost, [(j, t), (k, s)])
    return best


def incremental(
    weights: torch.Tensor, groups: torch.Tensor, held: torch.Tensor, slots: torch.Tensor, max_steps: int
) -> list[torch.Tensor]:
    """Snapshots of one layer's assignment, from "current copies kept" to a local optimum.

    weights `[P]`, groups `[P]` (logical expert of each copy), held `[E,S]` bool (servers holding a
    copy now), slots `[S]`. Copies whose expert is still on a held server with room stay there;
    the rest go heaviest first to the least-loaded server that can take them; then each step moves
    (or swaps) copies off the busiest server while its load drops, at most `max_steps` steps.
    Returns the assignment `[P]` (server index per copy) after the repair and after every step.
    """
    num_items = len(weights)
    wl, gl = weights.tolist(), groups.tolist()
    st = LayerPacker(slots, held.shape[0], num_items)
    order = torch.sort(weights, descending=True, stable=True).indices.tolist()
    rest = []
    for i in order:
        keep = held[gl[i]] & (st.free > 0) & ~st.on[gl[i]]
        if keep.any():
            st.place(i, gl[i], wl[i], int(torch.nonzero(keep)[0]))
        else:
            rest.append(i)
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    for i in rest:
        cand = (st.free > 0) & ~st.on[gl[i]]
        if cand.any():
            st.place(i, gl[i], wl[i], int(torch.argmin(torch.where(cand, st.load, inf))))
        else:
            st.augment(i, gl, wl)
    snapshots = [st.server.clone()]
    for _ in range(max_steps):
        step = _best_step(st, gl, wl)
        if step is None:
            break
        for j, _dst in step[1]:
            st.remove(j, gl[j], wl[j])
        for j, dst in step[1]:
            st.place(j, gl[j], wl[j], dst)
        snapshots.append(st.server.clone())
    return snapshots
