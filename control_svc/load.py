"""The observed expert load: each live expert server's sliding-window token counts, summed.

Shape letters: L MoE layers, E logical experts.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

from control_svc.cost_model import WorkSample
from moemesh.errors import invalid

MAX_WINDOW_S = 3600.0  # the longest load window a heartbeat may claim
MAX_CPUS = 4096.0  # the most CPUs a heartbeat may claim to use or be limited to


def window_load(stats: Iterable[object], layers: Sequence[int], num_experts: int) -> torch.Tensor:
    """[L, E] int64 tokens per (MoE layer in `layers` order, logical expert) over the servers'
    load windows; `stats` are moemesh.v1.ExpertStats (None entries and unknown layers are skipped)."""
    row = {layer: i for i, layer in enumerate(layers)}
    out = torch.zeros(len(layers), num_experts, dtype=torch.int64)
    for s in stats:
        if s is None:
            continue
        for load in s.loads:
            i = row.get(load.layer)
            if i is not None and 0 <= load.expert_id < num_experts:
                out[i, load.expert_id] += load.tokens
    return out


def bounded_stats(stats, layers: Sequence[int], num_experts: int, max_tokens_per_s: float):
    """A copy of a heartbeat's moemesh.v1.ExpertStats fit to enter the load: MeshError
    INVALID_ARGUMENT naming the field for a (layer, expert) the model does not have; each count
    clamped to `max_tokens_per_s` over the claimed window (at most MAX_WINDOW_S; a non-finite or
    non-positive window counts as 1 s), non-finite times as 0. So a forged or broken heartbeat can
    neither overflow the load nor outweigh every real server by orders of magnitude. Its window work
(`ExpertWork`) is bounded likewise: counts at the same cap, seconds within its window."""
    moe = set(layers)
    for i, load in enumerate(stats.loads):
        if load.layer not in moe:
            raise invalid(f"stats.loads[{i}].layer: {load.layer} is not a MoE layer (MoE layers: {sorted(moe)})")
        if not 0 <= load.expert_id < num_experts:
            raise invalid(f"stats.loads[{i}].expert_id: {load.expert_id} is not in [0, {num_experts})")
    out = type(stats)()
    out.CopyFrom(stats)
    window = stats.window_seconds if math.isfinite(stats.window_seconds) and stats.window_seconds > 0 else 1.0
    out.window_seconds = min(window, MAX_WINDOW_S)
    cap = int(max_tokens_per_s * out.window_seconds)
    for load in out.loads:
        load.tokens = min(load.tokens, cap)
    if not math.isfinite(out.busy_seconds) or out.busy_seconds < 0:
        out.busy_seconds = 0.0
    work = out.window_work
    work.seconds = min(work.seconds, MAX_WINDOW_S) if math.isfinite(work.seconds) and work.seconds > 0 else 0.0
    for name in ("busy_seconds", "service_seconds"):  # no more computing than the window holds
        value = getattr(work, name)
        setattr(work, name, min(value, work.seconds) if math.isfinite(value) and value > 0 else 0.0)
    for name in ("requests", "expert_calls", "rows"):
        setattr(work, name, min(getattr(work, name), cap))
    for name in ("cpu_seconds", "compute_cpu_seconds", "call_cpu_seconds", "change_cpu_seconds"):
        value = getattr(work, name)
        setattr(work, name, min(value, work.seconds * MAX_CPUS) if math.isfinite(value) and value > 0 else 0.0)
    work.cpu_limit = min(work.cpu_limit, MAX_CPUS) if math.isfinite(work.cpu_limit) and work.cpu_limit > 0 else 0.0
    return out


def work_sample(w) -> WorkSample:
    """A heartbeat's moemesh.v1.ExpertWork (after `bounded_stats`) -> the cost model's WorkSample."""
    return WorkSample(w.seconds, w.requests, w.expert_calls, w.rows, w.busy_seconds, w.service_seconds, w.cpu_seconds, w.cpu_limit,
                      w.compute_cpu_seconds, w.call_cpu_seconds, w.change_cpu_seconds)
