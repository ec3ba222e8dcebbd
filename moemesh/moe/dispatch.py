"""The dispatch plan: which token rows go to which expert, in expert order, with capacity.

Shape legend: T tokens, E experts, K top-k, N kept token-expert pairs, G experts with rows.

A plan that sends every token to every expert (top-k == E, nothing dropped) holds the routing weights
[T, E] as they are (`by_expert`) and no rows: the in-process expert compute runs it as two matmuls
over the experts side by side; the rows are built (`with_rows`) only where a consumer needs them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from kernels.cpu import step_ops
from moemesh.moe.gate import Routing, softmax_topk


@dataclass(frozen=True)
class DispatchPlan:
    """Kept token-expert pairs sorted by expert: what `ExpertCompute.submit` computes and combines.

    token_idx    [N] int64  source token of each row
    weights      [N] float32 combine weight of each row
    expert_ids   [G] int64  experts that receive rows (ascending)
    counts       [G] int64  rows per expert (sum == N)
    capacity     rows per expert the plan is padded to (None when dropless); an expert never gets more
    dropped      pairs that did not fit (contribute nothing to the output)
    by_expert    [T, E] float32 combine weight of every token for every expert 0..E-1 when every
                 token goes to every expert (top-k == E, nothing dropped); the four row fields are
                 then None until `with_rows`. None for any other plan.
    """

    token_idx: Tensor | None
    weights: Tensor | None
    expert_ids: Tensor | None
    counts: Tensor | None
    capacity: int | None
    dropped: int
    by_expert: Tensor | None = None

    @property
    def num_rows(self) -> int:
        if self.by_expert is not None:
            return self.by_expert.numel()
        return int(self.token_idx.shape[0])

    def with_rows(self) -> "DispatchPlan":
        """This plan with its row fields: an all-experts plan's rows in (expert, token) order (row
        e*T + t belongs to token t, weight by_expert[t, e]); any other plan as it is."""
        if self.by_expert is None or self.token_idx is not None:
            return self
        num_tokens, num_experts = self.by_expert.shape
        device = self.by_expert.device
        return replace(
            self,
            token_idx=torch.arange(num_tokens, device=device).repeat(num_experts),  # [E*T]
            weights=self.by_expert.t().reshape(-1),  # [E*T]
            expert_ids=torch.arange(num_experts, device=device),
            counts=torch.full((num_experts,), num_tokens, dtype=torch.long, device=device),
        )


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float, max_count: int) -> int | None:
    """Rows allowed per expert: cf > 0 -> ceil(k*cf*T/E); cf == 0 -> unlimited (None);
    cf < 0 -> min(busiest expert's load, ceil(k*|cf|*T/E))."""
    if capacity_factor == 0:
        return None
    bound = math.ceil(top_k * abs(capacity_factor) * num_tokens / num_experts)
    return bound if capacity_factor > 0 else min(max_count, bound)


def make_plan(routing: Routing, num_experts: int, capacity_factor: float = 0.0) -> DispatchPlan:
    """Sort the T*K choices by expert. Priority within an expert when capacity binds: all first choices
    (in token order) before any second choice, and so on (as Tutel does)."""
    num_tokens, top_k = routing.weights.shape
    if top_k == num_experts and num_tokens:
        capacity = expert_capacity(num_tokens, num_experts, top_k, capacity_factor, max_count=num_tokens)
        if capacity is None or capacity >= num_tokens:  # every token to every expert, nothing dropped
            return all_experts_plan(routing, capacity)
    if routing.expert_ids is None:  # all experts, but capacity binds (or no tokens): choices in weight order set the priority
        routing = Routing(*reversed(torch.topk(routing.weights, top_k, dim=-1)))
    ids = routing.expert_ids  # [T, K]
    # Flatten slot-major so that a stable sort by expert keeps (slot, token) priority order: flat
    # position i holds slot i // T of token i % T.
    if num_tokens == 1:  # one token: slot-major is the stored order
        flat_ids, flat_w = ids.reshape(-1), routing.weights.reshape(-1)  # [K]
    else:
        flat_ids = ids.t().reshape(-1)  # [K*T]
        flat_w = routing.weights.t().reshape(-1)  # [K*T]
    sorted_ids, order = torch.sort(flat_ids, stable=True)  # [K*T] each
    if capacity_factor == 0 and num_tokens:
        # Dropless (the default): the sorted ids give the groups directly, without per-expert
        # counts over all E, a capacity or a host sync.
        expert_ids, counts = torch.unique_consecutive(sorted_ids, return_counts=True)  # [G] each
        return DispatchPlan(
            token_idx=order % num_tokens, weights=flat_w[order], expert_ids=expert_ids, counts=counts,
            capacity=None, dropped=0,
        )
    flat_tok = torch.arange(num_tokens, device=ids.device).repeat(top_k)  # [K*T]
    all_counts = torch.bincount(sorted_ids, minlength=num_experts)  # [E]
    max_count = int(all_counts.max()) if sorted_ids.numel() else 0
    capacity = expert_capacity(num_tokens, num_experts, top_k, capacity_factor, max_count)
    dropped = 0
    if capacity is not None and max_count > capacity:
        starts = torch.cumsum(all_counts, 0) - all_counts  # [E]
        rank = torch.arange(sorted_ids.numel(), device=ids.device) - starts[sorted_ids]  # [K*T] rank within expert
        keep = rank < capacity
        dropped = int((~keep).sum())
        order = order[keep]
        sorted_ids = sorted_ids[keep]
        all_counts = all_counts.clamp(max=capacity)
    present = all_counts > 0
    return DispatchPlan(
        token_idx=flat_tok[order],
        weights=flat_w[order],
        expert_ids=torch.nonzero(present).flatten(),
        counts=all_counts[present],
        capacity=capacity,
        dropped=dropped,
    )


def route(router_logits: Tensor, top_k: int, normalize: bool, num_experts: int, capacity_factor: float = 0.0) -> DispatchPlan:
    """router_logits [T, E] -> `make_plan(softmax_topk(router_logits, top_k, normalize), ...)`: one
    compiled call on the CPU for a dropless plan (capacity_factor 0) with top_k < E where
    `kernels.cpu.step_ops.route_topk` runs (the same plan, weights to float rounding)."""
    if capacity_factor == 0 and 1 <= top_k < num_experts == router_logits.shape[-1] and router_logits.shape[0]:
        made = step_ops.route_topk(router_logits, top_k, normalize)
        if made is not None:
            token_idx, weights, expert_ids, counts = made
            return DispatchPlan(token_idx, weights, expert_ids, counts, capacity=None, dropped=0)
    return make_plan(softmax_topk(router_logits, top_k, normalize), num_experts, capacity_factor)


def all_experts_plan(routing: Routing, capacity: int | None) -> DispatchPlan:
    """Every token goes to every expert: the weights by expert [T, E], no rows, no sort."""
    by_expert = routing.weights  # [T, E], columns in expert order
    if routing.expert_ids is not None:  # columns in each token's choice order
        by_expert = torch.zeros_like(by_expert).scatter_(1, routing.expert_ids, by_expert)
    return DispatchPlan(None, None, None, None, capacity=capacity, dropped=0, by_expert=by_expert)
