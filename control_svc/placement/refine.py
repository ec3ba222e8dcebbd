"""Incremental placement of one layer: keep the current copies, add the missing ones, then move
copies off the busiest server one at a time while that lowers its load.

Shape letters: P copies (items) of the layer, E logical experts, S servers.
"""
from __future__ import annotations

import torch

from control_svc.placement.pack import LayerPacker


def _best_step(st: LayerPacker, groups: torch.Tensor, weights: torch.Tensor) -> list[tuple[int, int]] | None:
    """The move (one copy) or swap (two copies) off the busiest server that leaves the larger of
    the two servers' loads lowest; a move wins a tie. Returns [(item, destination), ...] or None
    when nothing lowers the busiest server's load. Vectorised over items `[m]` on that server,
    servers `[S]` and all items `[P]`."""
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    s = int(torch.argmax(st.load))
    peak = st.load[s]
    mine = torch.nonzero(st.server == s).reshape(-1)
    if len(mine) == 0:
        return None
    wj, gj = weights[mine], groups[mine]
    ok_move = ~st.on[gj] & (st.free > 0).unsqueeze(0)
    ok_move[:, s] = False
    move = torch.where(ok_move, torch.maximum(peak - wj[:, None], st.load[None, :] + wj[:, None]), inf)
    tk = st.server
    ok_swap = (
        (tk != s)[None, :]
        & (weights[None, :] < wj[:, None])
        & ~st.on[groups, s][None, :]
        & ~st.on[gj[:, None], tk[None, :]]
    )
    swap = torch.where(
        ok_swap,
        torch.maximum(peak - wj[:, None] + weights[None, :], st.load[tk][None, :] + wj[:, None] - weights[None, :]),
        inf,
    )
    best_move, best_swap = move.min(), swap.min()
    if min(float(best_move), float(best_swap)) >= float(peak) - 1e-12:
        return None
    if best_move <= best_swap:
        j, t = divmod(int(torch.argmin(move)), move.shape[1])
        return [(int(mine[j]), t)]
    j, k = divmod(int(torch.argmin(swap)), swap.shape[1])
    return [(int(mine[j]), int(tk[k])), (k, s)]


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
    weights = weights.to(torch.float64)
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
        step = _best_step(st, groups, weights)
        if step is None:
            break
        for j, _dst in step:
            st.remove(j, gl[j], wl[j])
        for j, dst in step:
            st.place(j, gl[j], wl[j], dst)
        snapshots.append(st.server.clone())
    return snapshots
