import pytest
from hypothesis import given, settings, strategies as st

from control_svc.placement import ServerBudget, initial_placement


def test_round_robin_rotates_per_layer():
    p = initial_placement(2, 5, ["a", "b"])
    assert [c[0] for c in p.replicas[0]] == ["a", "b", "a", "b", "a"]
    assert [c[0] for c in p.replicas[1]] == ["b", "a", "b", "a", "b"]
    assert p.version == 0


def test_skips_full_servers():
    p = initial_placement([4], 4, [ServerBudget("a", 1), ServerBudget("b", 3)])
    assert p.experts_on("a") == {4: (0,)}
    assert p.experts_on("b") == {4: (1, 2, 3)}


def test_too_small_names_servers():
    with pytest.raises(ValueError, match="servers"):
        initial_placement(1, 4, [ServerBudget("a", 1), ServerBudget("b", 2)])
    with pytest.raises(ValueError, match="num_experts"):
        initial_placement(1, 0, ["a"])
    with pytest.raises(ValueError, match="layers"):
        initial_placement([], 2, ["a"])


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.integers(1, 20), st.integers(1, 6))
def test_balanced_counts(layers, experts, servers):
    ids = [f"s{i}" for i in range(servers)]
    p = initial_placement(layers, experts, ids)
    for layer in p.layers:
        counts = [sum(1 for c in p.replicas[layer] if c == (s,)) for s in ids]
        assert max(counts) - min(counts) <= 1 and sum(counts) == experts
