import pytest
import torch

from control_svc.placement import (
    RebalancePolicy, ServerBudget, balancedness, initial_placement, placement_diff, propose, solve,
)

SERVERS = [ServerBudget(f"s{i}", 3) for i in range(4)]


def skewed(layers=2, experts=8):
    return torch.tensor([[1000.0 / (e + 1) ** 1.5 for e in range(experts)]] * layers)


def test_proposes_a_better_placement_on_skew():
    current = initial_placement(2, 8, SERVERS)
    new = propose(skewed(), SERVERS, current, RebalancePolicy(min_gain=0.05, min_tokens=100))
    assert new is not None and new.version == current.version + 1
    assert balancedness(skewed(), new) >= balancedness(skewed(), current) + 0.05


def test_keeps_current_when_gain_small_or_window_thin():
    current = solve(skewed(), SERVERS)
    assert propose(skewed() * 1.01, SERVERS, current, RebalancePolicy(min_tokens=100)) is None
    init = initial_placement(2, 8, SERVERS)
    assert propose(skewed() * 0.001, SERVERS, init, RebalancePolicy(min_tokens=100)) is None  # 3 tokens
    assert propose(skewed(), SERVERS, init, RebalancePolicy(min_gain=0.9, min_tokens=100)) is None


def test_max_moves_caps_a_switch():
    init = initial_placement(2, 8, SERVERS)
    full = propose(skewed(), SERVERS, init, RebalancePolicy(min_tokens=0))
    moves = placement_diff(init, full).moves
    assert propose(skewed(), SERVERS, init, RebalancePolicy(min_tokens=0, max_moves=moves - 1)) is None
    assert propose(skewed(), SERVERS, init, RebalancePolicy(min_tokens=0, max_moves=moves)) == full


def test_lost_server_forces_a_new_placement():
    current = solve(skewed(), SERVERS)
    survivors = SERVERS[:3]
    new = propose(torch.zeros(2, 8), survivors, current, RebalancePolicy(min_tokens=10**9, min_gain=1.0))
    assert new is not None and "s3" not in new.servers()


@pytest.mark.parametrize(
    "kwargs, field",
    [({"min_gain": 2.0}, "min_gain"), ({"min_tokens": -1}, "min_tokens"), ({"max_moves": -1}, "max_moves"), ({"tolerance": -0.1}, "tolerance")],
)
def test_policy_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RebalancePolicy(**kwargs)


def test_budget_from_total():
    assert ServerBudget.from_total("a", 0, 4, 8).slots == 8
    assert ServerBudget.from_total("a", 10, 4, 8).slots == 2
    assert ServerBudget.from_total("a", 1000, 4, 8).slots == 8
    with pytest.raises(ValueError, match="total_slots"):
        ServerBudget.from_total("a", -1, 4, 8)
