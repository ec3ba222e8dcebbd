from collections import Counter

import pytest

from control_svc.initial_placement import round_robin_placement


def per_server(p):
    return Counter(s for experts in p.replicas.values() for copies in experts for s in copies)


@pytest.mark.parametrize("n_servers", [1, 2, 3, 5])
def test_every_expert_placed_once_and_balanced(n_servers):
    servers = [(f"s{i}", 0) for i in range(n_servers)]
    p = round_robin_placement([1, 3, 5], 8, servers, version=1)
    assert p.version == 1 and p.layers == (1, 3, 5)
    for layer in p.layers:
        assert len(p.replicas[layer]) == 8 and all(len(c) == 1 for c in p.replicas[layer])
    counts = per_server(p)
    assert sum(counts.values()) == 24 and len(counts) == n_servers
    assert max(counts.values()) - min(counts.values()) <= 1


def test_layers_are_spread_over_servers():
    p = round_robin_placement([0, 1], 4, [("a", 0), ("b", 0)], version=1)
    for layer in p.layers:
        assert Counter(c[0] for c in p.replicas[layer]) == {"a": 2, "b": 2}


def test_budgets_are_respected():
    servers = [("small", 2), ("big", 0), ("mid", 5)]
    p = round_robin_placement([0, 1], 8, servers, version=3)
    counts = per_server(p)
    assert counts["small"] <= 2 and counts["mid"] <= 5 and sum(counts.values()) == 16


def test_exact_budget_fits_and_short_budget_is_refused():
    p = round_robin_placement([0], 6, [("a", 1), ("b", 5)], version=1)
    assert per_server(p) == {"a": 1, "b": 5}
    with pytest.raises(ValueError, match="slot_budget"):
        round_robin_placement([0, 1], 8, [("a", 4), ("b", 4)], version=1)
    with pytest.raises(ValueError, match="servers"):
        round_robin_placement([0], 8, [], version=1)
