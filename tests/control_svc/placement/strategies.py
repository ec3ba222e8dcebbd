"""Hypothesis strategies shared by the placement tests: loads and server budgets that can hold them."""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from control_svc.placement import ServerBudget


@st.composite
def problems(draw, max_layers: int = 3, max_experts: int = 12, max_servers: int = 6):
    """(load[L,E], servers, num_physical): budgets that hold every expert, P within what they hold."""
    num_layers = draw(st.integers(1, max_layers))
    num_experts = draw(st.integers(1, max_experts))
    num_servers = draw(st.integers(1, max_servers))
    slots = draw(st.lists(st.integers(0, num_experts), min_size=num_servers, max_size=num_servers))
    room = sum(min(b, num_experts) for b in slots)
    if room < num_experts:  # top up the first server so every expert fits
        slots[0] += num_experts - room
    room = sum(min(b, num_experts) for b in slots)
    num_physical = draw(st.integers(num_experts, room))
    skew = draw(st.floats(0.0, 3.0))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    load = (torch.rand(num_layers, num_experts, generator=g, dtype=torch.float64) ** (1 + 3 * skew)) * 1000
    servers = [ServerBudget(f"s{i}", b) for i, b in enumerate(slots)]
    return load, servers, num_physical
