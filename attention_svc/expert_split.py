"""How one MoE layer call divides over expert servers, and how their answers add up.

Shape legend: T tokens, N rows (kept token-expert pairs) grouped by expert, G experts with rows,
E experts of the layer, H hidden; per server s: T_s tokens it needs, N_s rows, G_s experts.

`split_plan` gives each server its rows (grouped by expert) and the tokens they read, each once (a
plan sending every token to every expert straight from its weights by expert, `split_every_expert`);
`partial_sum` adds the servers' weighted partial sums back into [T, H]. The index work runs on numpy
arrays: a handful of small operations per call, whatever the number of experts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from moemesh.moe.dispatch import DispatchPlan


@dataclass(frozen=True)
class ServerPart:
    """What one expert server computes of one layer call."""

    server_id: str
    tokens: Tensor | None  # [T_s] int64 rows of x the server needs, ascending; None: all T, in order
    token_idx: Tensor  # [N_s] int32 row -> index into the server's tokens
    weights: Tensor  # [N_s] float32 combine weight of each row
    expert_ids: Tensor  # [G_s] int64 logical experts, each once, ascending
    counts: Tensor  # [G_s] int64 rows per expert


@dataclass(frozen=True)
class LayerCopies:
    """One layer's placement as the split reads it, built once per placement.
    copies  per expert, the servers holding it (each once)
    names   every server of the layer, sorted
    owner   [E] index into names of each expert's only copy; None when some expert has several"""

    copies: tuple[tuple[str, ...], ...]
    names: tuple[str, ...]
    owner: np.ndarray | None

    @classmethod
    def of(cls, copies: Sequence[Sequence[str]]) -> "LayerCopies":
        copies = tuple(tuple(dict.fromkeys(c)) for c in copies)
        names = tuple(sorted({s for c in copies for s in c}))
        index = {sid: i for i, sid in enumerate(names)}
        sole = all(len(c) == 1 for c in copies)
        return cls(copies, names, np.array([index[c[0]] for c in copies], dtype=np.int64) if sole else None)

    def chunks(self, expert_ids: np.ndarray, counts: np.ndarray, whole: bool, rotation: int) -> tuple[np.ndarray, ...]:
        """The rows of experts expert_ids [G] (counts [G] each, in that order) as chunks in row order:
        (server index, expert, rows) [C] each. An expert's rows are split into near-equal contiguous
        chunks over its copies, the first going to copy e % r (so single rows spread); `whole` gives
        each expert's rows to one copy, (e + rotation) % r."""
        if self.owner is not None:
            return self.owner[expert_ids], expert_ids, counts
        index = {sid: i for i, sid in enumerate(self.names)}
        server, expert, rows = [], [], []
        for e, n in zip(expert_ids.tolist(), counts.tolist()):
            copies = self.copies[e]
            r = len(copies)
            takes = [((e + rotation) % r, n)] if whole else [((e + k) % r, n // r + (k < n % r)) for k in range(r)]
            for k, take in takes:
                if take:
                    server.append(index[copies[k]])
                    expert.append(e)
                    rows.append(take)
        return np.array(server, dtype=np.int64), np.array(expert, dtype=np.int64), np.array(rows, dtype=np.int64)


def split_plan(plan: DispatchPlan, layer: LayerCopies, num_tokens: int, rotation: int = 0) -> list[ServerPart]:
    """The plan's rows by server (servers sorted by id; see `LayerCopies.chunks`): a plan that sends
    every token to every expert (`plan.by_expert`) computes each expert whole on one copy, rotating
    per call, so a server gets every token for each expert it computes."""
    if plan.by_expert is not None:
        return split_every_expert(plan.by_expert, layer, rotation)
    expert_ids, counts = plan.expert_ids.cpu().numpy(), plan.counts.cpu().numpy()
    if expert_ids.size and not (0 <= expert_ids.min() and expert_ids.max() < len(layer.copies)):
        raise ValueError(f"expert_ids: {expert_ids.tolist()} go beyond the placement's {len(layer.copies)} experts")
    server, expert, rows = layer.chunks(expert_ids, counts, False, rotation)
    by_server = np.argsort(np.repeat(server, rows), kind="stable")  # [N]: server 0's rows, then 1's, ...; each grouped by expert
    sizes = np.zeros(len(layer.names), dtype=np.int64)
    np.add.at(sizes, server, rows)
    token_idx, weights = plan.token_idx.cpu().numpy(), plan.weights.cpu().numpy()
    parts = []
    for i, part_rows in enumerate(np.split(by_server, np.cumsum(sizes)[:-1])):
        if not part_rows.size:
            continue
        tokens, local = server_tokens(token_idx[part_rows], num_tokens)
        mine = server == i
        parts.append(ServerPart(
            server_id=layer.names[i],
            tokens=None if tokens is None else torch.from_numpy(tokens),
            token_idx=torch.from_numpy(local.astype(np.int32)),
            weights=torch.from_numpy(weights[part_rows]),
            expert_ids=torch.from_numpy(expert[mine]),
            counts=torch.from_numpy(rows[mine]),
        ))
    return parts


def split_every_expert(by_expert: Tensor, layer: LayerCopies, rotation: int) -> list[ServerPart]:
    """`split_plan` of a plan sending every token to every expert, from its weights by_expert [T, E]
    without building the plan's rows: each expert whole on one copy, (e + rotation) % r; a server gets
    every token (in order) for each expert it computes, its rows grouped by expert, ascending."""
    num_tokens, num_experts = by_expert.shape
    if num_experts != len(layer.copies):
        raise ValueError(f"expert_ids: the plan's {num_experts} experts are not the placement's {len(layer.copies)}")
    experts = np.arange(num_experts, dtype=np.int64)
    server, _, _ = layer.chunks(experts, np.full(num_experts, num_tokens, dtype=np.int64), True, rotation)  # [E]
    by_row = by_expert.t().cpu()  # [E, T]
    tokens = torch.arange(num_tokens, dtype=torch.int32)  # [T]
    parts = []
    for i, name in enumerate(layer.names):
        mine = torch.from_numpy(np.flatnonzero(server == i))  # [G_s] ascending
        if not mine.numel():
            continue
        parts.append(ServerPart(
            server_id=name, tokens=None, token_idx=tokens.repeat(mine.numel()), weights=by_row[mine].reshape(-1),
            expert_ids=mine, counts=torch.full((mine.numel(),), num_tokens, dtype=torch.int64),
        ))
    return parts


def server_tokens(rows_token: np.ndarray, num_tokens: int) -> tuple[np.ndarray | None, np.ndarray]:
    """rows_token [N_s]: each row's token among the T -> (the tokens the rows read, ascending [T_s],
    or None when that is all T; each row's index into them [N_s])."""
    seen = np.zeros(num_tokens, dtype=bool)
    seen[rows_token] = True
    if seen.all():
        return None, rows_token
    position = np.cumsum(seen) - 1  # [T]: a read token's index among the read ones
    return np.flatnonzero(seen), position[rows_token]


def partial_sum(x: Tensor, parts: list[ServerPart], partials: Mapping[str, Tensor]) -> Tensor:
    """The servers' partial sums y_s [T_s, H] added into [T, H] in float32, in the parts' (sorted
    server) order, whichever answered first; returned in x.dtype on x.device."""
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    for part in parts:
        y = partials[part.server_id].to(acc.device, torch.float32)
        if part.tokens is None:
            acc += y
        else:
            acc.index_add_(0, part.tokens.to(acc.device), y)
    return acc.to(x.dtype)
