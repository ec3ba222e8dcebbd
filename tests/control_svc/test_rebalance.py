import torch

from control_svc.initial_placement import round_robin_placement
from control_svc.placement import RebalancePolicy, ServerBudget, placement_diff
from control_svc.rebalance import plan_rebalance

LAYERS = (0, 1)
BUDGETS = [ServerBudget("a", 8), ServerBudget("b", 8)]
CURRENT = round_robin_placement(LAYERS, 8, [("a", 0), ("b", 0)], version=3)  # even experts on a


def skewed(total: int) -> torch.Tensor:
    load = torch.full((2, 8), total // 100, dtype=torch.int64)
    load[:, 0] = load[:, 2] = total // 3  # hot experts, both on server a
    return load


def test_skewed_load_is_rebalanced_with_replicas_of_the_hot_experts():
    plan = plan_rebalance(skewed(30_000), BUDGETS, CURRENT, LAYERS, RebalancePolicy(min_tokens=100), num_physical=10)
    assert plan.placement is not None and plan.placement.version == 4
    assert plan.before < 0.6 and plan.after > 0.9
    assert plan.moves == placement_diff(CURRENT, plan.placement).moves > 0
    for layer in LAYERS:
        assert len(plan.placement.replicas[layer][0]) == 2 and len(plan.placement.replicas[layer][2]) == 2
        assert sum(len(c) for c in plan.placement.replicas[layer]) == 10  # replica count respected


def test_policy_thresholds_keep_the_current_placement_and_say_why():
    thin = plan_rebalance(skewed(300), BUDGETS, CURRENT, LAYERS, RebalancePolicy(min_tokens=10_000))
    assert thin.placement is None and "min_tokens" in thin.reason
    greedy = plan_rebalance(skewed(30_000), BUDGETS, CURRENT, LAYERS, RebalancePolicy(min_tokens=100, min_gain=0.9))
    assert greedy.placement is None and "min_gain" in greedy.reason
    capped = plan_rebalance(skewed(30_000), BUDGETS, CURRENT, LAYERS, RebalancePolicy(min_tokens=100, max_moves=1), num_physical=10)
    assert capped.placement is None and "max_moves" in capped.reason


def test_force_ignores_thresholds_and_a_lost_server_is_always_re_solved():
    forced = plan_rebalance(skewed(300), BUDGETS, CURRENT, LAYERS, RebalancePolicy(min_tokens=10_000), force=True)
    assert forced.placement is not None
    lost = plan_rebalance(torch.zeros(2, 8, dtype=torch.int64), [ServerBudget("a", 8)], CURRENT, LAYERS, RebalancePolicy())
    assert lost.placement is not None and lost.placement.servers() == ("a",)


def test_balanced_load_keeps_the_current_placement():
    plan = plan_rebalance(torch.full((2, 8), 1000), BUDGETS, CURRENT, LAYERS, RebalancePolicy(min_tokens=100))
    assert plan.placement is None and plan.before == plan.after == 1.0
