"""The cost model and the rebalance policy as pure functions: calibration from the servers' window
work, the step time of a placement, the switch's cost, and which placements are committed."""
import math
from dataclasses import replace

import pytest
import torch

from control_svc.cost_model import (
    CostPriors, ExpertShape, Prediction, ServerCost, StepCosts, SwitchCost, WorkSample, calibrate, expert_seconds, predict,
    rows_per_step, switch_cost,
)
from control_svc.placement import (
    CostInputs, RebalancePolicy, ServerBudget, initial_placement, placement_diff, plan_rebalance,
)
from moemesh.contracts.placement import Placement

SHAPE = ExpertShape(hidden_size=256, intermediate_size=128, weight_bytes=2, activation_bytes=2, top_k=2)


def sample(expert_calls: int, rows: int, requests: int, expert_s: float, row_s: float, call_s: float, seconds: float = 10.0,
           slowdown: float = 1.0) -> WorkSample:
    busy = slowdown * (expert_calls * expert_s + rows * row_s)
    return WorkSample(seconds, requests, expert_calls, rows, busy, busy + requests * call_s, cpu_s=busy, cpu_limit=0.5)


def test_calibration_recovers_the_servers_costs_and_the_step_rate():
    expert_s, row_s, call_s = 300e-6, 20e-6, 150e-6
    work = {
        "a": sample(4000, 60000, 1600, expert_s, row_s, call_s),  # hot: many rows per expert
        "b": sample(3000, 9000, 1200, expert_s, row_s, call_s),
        "c": sample(3200, 10000, 1300, expert_s, row_s, call_s),
    }
    costs = calibrate(work, SHAPE, num_layers=16)
    assert costs.calibrated and costs.steps == pytest.approx(1600 / 16)
    assert costs.step_s == pytest.approx(10.0 / 100)
    assert costs.cpu_limit == {"a": 0.5, "b": 0.5, "c": 0.5} and costs.cpu_per_step["b"] == pytest.approx(work["b"].cpu_s / 100)
    for sid in work:
        got = costs.server(sid)
        assert (got.call_s, got.expert_s, got.row_s) == pytest.approx((call_s, expert_s, row_s), rel=0.05)  # the pull towards the priors is slight
    assert costs.server("new") == costs.default and costs.default in costs.servers.values()


def test_a_server_on_a_smaller_budget_is_priced_slower():
    expert_s, row_s, call_s = 300e-6, 20e-6, 150e-6
    work = {
        "a": sample(4000, 60000, 1600, expert_s, row_s, call_s),
        "b": sample(3000, 9000, 1200, expert_s, row_s, call_s),
        "c": sample(3200, 10000, 1300, expert_s, row_s, call_s, slowdown=2.0),  # half the CPU budget
    }
    costs = calibrate(work, SHAPE, num_layers=16)
    # one window per server cannot tell a slower server from a different split between experts and
    # rows; each server's own compute is reproduced, and c comes out the slowest
    for sid, w in work.items():
        got = costs.server(sid)
        assert got.expert_s * w.expert_calls + got.row_s * w.rows == pytest.approx(w.busy_s, rel=1e-6)
    assert costs.server("c").row_s > 1.3 * max(costs.server("a").row_s, costs.server("b").row_s)


def test_without_reports_the_priors_stand():
    costs = calibrate({"a": WorkSample(10, 3, 3, 3, 0.1, 0.2)}, SHAPE, 4)  # too few calls to count
    assert not costs.calibrated and costs.steps is None and costs.step_s is None
    prior = CostPriors().server(SHAPE)
    assert costs.server("a") == prior
    assert prior.expert_s == pytest.approx(SHAPE.expert_bytes / CostPriors().read_bytes_s)
    rows = rows_per_step(torch.tensor([[30.0, 10.0, 0.0]]), costs, top_k=2)
    assert rows.tolist() == [[1.5, 0.5, 0.0]]  # as if a step carried one token (top_k rows a layer)


def test_a_layer_waits_for_its_slowest_server():
    costs = StepCosts(ServerCost(call_s=1.0, expert_s=10.0, row_s=100.0), fanout_s=0.5, row_bytes=0)
    p = Placement(1, {0: (("a",), ("b",), ("a", "b"))})
    rows = torch.tensor([[2.0, 0.0, 4.0]])
    # a: expert 0 (2 rows) + half of expert 2 (2 rows) -> 4 rows, two experts; b: 2 rows of expert 2
    pa, ta = -math.expm1(-4.0), 2 * -math.expm1(-2.0)
    pb, tb = -math.expm1(-2.0), -math.expm1(-2.0)
    want = max(pa * 1.0 + ta * 10.0 + 4 * 100.0, pb * 1.0 + tb * 10.0 + 2 * 100.0) + 0.5 * (pa + pb)
    assert expert_seconds(rows, p, [0], costs) == pytest.approx(want)


def test_the_rest_of_the_step_dilutes_the_gain():
    costs = StepCosts(ServerCost(0.0, 0.0, 1.0), fanout_s=0.0, row_bytes=0, steps=1.0, step_s=10.0)
    hot = Placement(1, {0: (("a",), ("a",))})
    spread = Placement(2, {0: (("a",), ("b",))})
    rows = torch.tensor([[2.0, 2.0]])
    p = predict(rows, hot, rows, spread, [0], costs)
    assert (p.step_s_before, p.step_s_after, p.other_s) == pytest.approx((10.0, 8.0, 6.0))  # experts 4 s of the 10 measured
    assert p.gain == pytest.approx(1.25)


def test_a_servers_cpu_budget_bounds_the_step():
    # 20 s of CPU a step on a server limited to 2 CPUs: no step shorter than 10 s, whatever its latency
    costs = StepCosts(ServerCost(0.0, 0.0, 1.0), fanout_s=0.0, row_bytes=0, steps=1.0, step_s=10.0,
                      cpu_per_step={"a": 20.0}, cpu_limit={"a": 2.0})
    hot = Placement(1, {0: (("a",), ("a",))})
    spread = Placement(2, {0: (("a",), ("b",))})
    rows = torch.tensor([[2.0, 2.0]])
    p = predict(rows, hot, rows, spread, [0], costs)  # a's share halves: its CPU too, 5 s a step
    # the budget explains the whole measured step (a waited out its quota): nothing else is left
    assert (p.step_s_before, p.step_s_after, p.other_s, p.budget_bound) == pytest.approx((10.0, 5.0, 0.0, True))
    # 4 s of the step are not the budget's: they add to it (a quota period left unused is lost)
    longer = predict(rows, hot, rows, spread, [0], replace(costs, step_s=14.0))
    assert (longer.other_s, longer.step_s_after, longer.budget_bound) == pytest.approx((4.0, 9.0, True))
    more = predict(rows, hot, rows * 3, hot, [0], costs)  # three times the rows on a: 60 s of CPU, 30 s a step
    assert (more.step_s_after, more.budget_bound) == (pytest.approx(30.0), True)
    assert more.gain == pytest.approx(1 / 3)


def test_switch_cost_counts_the_copies_loaded():
    assert switch_cost(3, SHAPE, None) == SwitchCost(3, 3 * SHAPE.expert_bytes, 3 * SHAPE.expert_bytes / CostPriors().load_bytes_s)
    assert switch_cost(4, SHAPE, 0.25).seconds == 1.0


# ---- the policy ---------------------------------------------------------------------------------
def test_the_policy_commits_only_what_is_faster_by_its_margin_and_pays_back():
    policy = RebalancePolicy(min_gain=0.1, payback_s=10.0, max_moves=8)
    cheap = SwitchCost(2, 1, 0.1)
    assert "below 1 + min_gain" in policy.refusal(Prediction(1.0, 1.0, 0.0), cheap)  # not faster
    assert "below 1 + min_gain" in policy.refusal(Prediction(1.0, 1.2, 0.0), cheap)  # slower
    assert "below 1 + min_gain" in policy.refusal(Prediction(1.05, 1.0, 0.0), cheap)  # faster, not by the margin
    assert policy.refusal(Prediction(1.2, 1.0, 0.0), cheap) == ""
    assert "max_moves" in policy.refusal(Prediction(1.2, 1.0, 0.0), SwitchCost(9, 1, 0.1))
    # 1.2x saves 1/6 of every second: 10 s of serving win back 1.67 s of loading, not 2
    assert "not won back within payback_s" in policy.refusal(Prediction(1.2, 1.0, 0.0), SwitchCost(2, 1, 2.0))
    assert policy.refusal(Prediction(1.2, 1.0, 0.0), SwitchCost(2, 1, 1.6)) == ""


LAYERS = (0, 1)
BUDGETS = [ServerBudget("a", 8), ServerBudget("b", 8)]
CURRENT = initial_placement(LAYERS, 8, [("a", 0), ("b", 0)], version=3)  # even experts on a


def skewed(total: int = 30_000) -> torch.Tensor:
    load = torch.full((2, 8), total // 100, dtype=torch.int64)
    load[:, 0] = load[:, 2] = total // 3  # hot experts, both on server a
    return load


def inputs(cost: ServerCost, steps: float = 1000.0, step_s: float | None = None) -> CostInputs:
    return CostInputs(StepCosts(cost, fanout_s=0.0, row_bytes=0, steps=steps, step_s=step_s, calibrated=True), SHAPE, top_k=2)


def test_rows_that_cost_make_the_hot_experts_spread_and_the_plan_is_priced():
    plan = plan_rebalance(skewed(), BUDGETS, CURRENT, LAYERS, RebalancePolicy(min_tokens=100), cost=inputs(ServerCost(0.0, 1e-6, 1e-3)))
    assert plan.placement is not None and plan.prediction.gain > 1.3
    assert plan.switch.copies == plan.moves == placement_diff(CURRENT, plan.placement).moves > 0
    assert plan.switch.bytes == plan.moves * SHAPE.expert_bytes
    for layer in LAYERS:  # each hot expert's rows now have a server of their own (or share both)
        owners = [set(plan.placement.replicas[layer][e]) for e in (0, 2)]
        assert owners[0] != owners[1] or owners[0] == {"a", "b"}


def test_a_placement_predicted_slower_is_not_committed():
    # the hot experts 0 and 2 already have a server each; the token balance wants their rows split
    # by replicas, but experts that cost far more to compute at all than per row make copies only
    # add work
    spread = Placement(3, {l: (("a",), ("a",), ("b",), ("b",), ("a",), ("b",), ("a",), ("b",)) for l in LAYERS})
    load = skewed()
    load[:, 0] = 12_000  # a little hotter than expert 2: the solver splits it
    cost = inputs(ServerCost(0.0, 1.0, 1e-9))
    plan = plan_rebalance(load, BUDGETS, spread, LAYERS, RebalancePolicy(min_tokens=100), num_physical=12, cost=cost)
    assert plan.placement is None and plan.prediction.gain < 1.0
    assert "no candidate is predicted faster" in plan.reason and plan.moves == 0
    forced = plan_rebalance(load, BUDGETS, spread, LAYERS, RebalancePolicy(min_tokens=100), num_physical=12, cost=cost, force=True)
    assert forced.placement is not None  # forced: switched whatever the prediction


def test_a_placement_not_faster_by_the_margin_is_not_committed():
    # the experts are a sliver of a long step: spreading them helps, but by less than the margin
    cost = inputs(ServerCost(0.0, 1e-6, 1e-3), steps=1000.0, step_s=1.0)
    plan = plan_rebalance(skewed(), BUDGETS, CURRENT, LAYERS, RebalancePolicy(min_tokens=100, min_gain=0.05), cost=cost)
    assert plan.placement is None and 1.0 < plan.prediction.gain < 1.05
    assert "below 1 + min_gain" in plan.reason and plan.moves > 0


def test_the_cost_model_chooses_between_moving_and_replicating():
    # with one copy per expert allowed too, per-expert costs favour moving a hot expert over
    # replicating it: the chosen plan loads no more copies than the experts it moves
    cost = inputs(ServerCost(0.0, 5e-3, 1e-3))
    plan = plan_rebalance(skewed(), BUDGETS, CURRENT, LAYERS, RebalancePolicy(min_tokens=100), cost=cost)
    assert plan.placement is not None
    assert all(sum(len(c) for c in plan.placement.replicas[l]) == 8 for l in LAYERS)


def test_the_cpu_fit_counts_each_call_so_spreading_spreads_calls_too():
    # every server pays 1 ms of CPU a call and 40 us a row, and may use 0.1 CPUs; one MoE layer, 10 s:
    # the hot server "a" is called at every step (400) with 37.5 rows and uses its whole budget, the
    # cold ones at some steps with a row or two
    def used(requests, rows, expert_calls):
        cpu = 1e-3 * requests + 40e-6 * rows
        return WorkSample(10.0, requests, expert_calls, rows, busy_s=0.5 * cpu, service_s=cpu, cpu_s=cpu, cpu_limit=0.1)

    work = {"a": used(400, 15000, 800), "b": used(250, 300, 250), "c": used(240, 280, 240), "d": used(200, 220, 200)}
    costs = calibrate(work, SHAPE, num_layers=1)
    u = costs.cpu_cost  # rows and experts computed go together here: the fit may split their cost, not the calls'
    assert u.call_s == pytest.approx(1e-3, rel=0.05)
    for w in work.values():
        assert u.call_s * w.requests + u.expert_s * w.expert_calls + u.row_s * w.rows == pytest.approx(w.cpu_s, rel=0.05)
    assert (costs.steps, costs.step_s) == pytest.approx((400, 0.025))
    hot = Placement(1, {0: (("a",), ("a",), ("b",), ("c",))})
    spread = Placement(2, {0: (("a",), ("b",), ("c",), ("d",))})
    rows = torch.tensor([[20.0, 17.5, 0.75, 0.6]])  # per step
    p = predict(rows, hot, rows, spread, [0], costs)
    # now a's 2.5 ms of CPU a step over 0.1 CPUs bound the step to 25 ms; spread, a and b each pay
    # a call and about 20 rows: about 1.8 ms and 1.9 ms, so about 19 ms a step
    assert p.budget_bound and p.step_s_before == pytest.approx(0.025, rel=0.01)
    assert p.step_s_after == pytest.approx(0.019, rel=0.1)


def _top_k_halving_gain(call_s: float, expert_s: float, row_s: float, split: bool = True) -> tuple[float, float, StepCosts]:
    """(predicted, true) gain of halving the rows for four servers that each get a call at every
    step (400 steps in 10 s, one MoE layer, four experts each, 0.1 CPUs each: the busiest one's
    CPU bounds the step), whose calls and kernels cost `call_s`, `expert_s` and `row_s` of CPU;
    `split`: the servers report their kernel's CPU apart."""
    rows = torch.tensor([[20.0] * 4 + [10.0] * 4 + [8.0] * 4 + [5.0] * 4])  # [1, 16] per step
    placement = Placement(1, {0: tuple((f"s{e // 4}",) for e in range(16))})

    def cpu(r) -> list[float]:  # each server's CPU a step: a call, the experts it computes, its rows
        out = []
        for s in range(4):
            share = r[0, 4 * s:4 * s + 4]
            out.append(call_s + expert_s * float((-torch.expm1(-share)).sum()) + row_s * float(share.sum()))
        return out

    work = {}
    for s, c in enumerate(cpu(rows)):
        compute = c - call_s
        share = rows[0, 4 * s:4 * s + 4]
        work[f"s{s}"] = WorkSample(10.0, 400, round(400 * float((-torch.expm1(-share)).sum())), round(400 * float(share.sum())),
                                   busy_s=400 * compute, service_s=400 * (compute + 50e-6), cpu_s=400 * c, cpu_limit=0.1,
                                   compute_cpu_s=400 * compute * split, call_cpu_s=400 * 0.6 * call_s * split)  # the rest: gRPC threads
    costs = calibrate(work, SHAPE, num_layers=1)
    p = predict(rows, placement, rows * 0.5, placement, [0], costs)
    return p.gain, max(cpu(rows)) / max(cpu(rows * 0.5)), costs


def test_a_call_heavy_server_gains_little_from_halving_its_rows_and_a_row_heavy_one_much():
    # every server gets the same number of calls: only the measured split tells a call's CPU from its rows'
    heavy_calls, true_calls, costs = _top_k_halving_gain(call_s=2e-3, expert_s=50e-6, row_s=4e-6)
    assert costs.cpu("s0").call_s == pytest.approx(2e-3, rel=1e-6)  # the process's CPU outside the kernel, per call
    assert heavy_calls == pytest.approx(true_calls, rel=0.03) and heavy_calls < 1.1
    heavy_rows, true_rows, costs = _top_k_halving_gain(call_s=0.3e-3, expert_s=100e-6, row_s=22e-6)
    assert costs.cpu("s0").call_s == pytest.approx(0.3e-3, rel=1e-6)
    assert heavy_rows == pytest.approx(true_rows, rel=0.03) and heavy_rows > 1.4



def test_a_placement_changes_cpu_is_not_charged_to_the_calls():
    # 400 calls, 1.0 s of process CPU: 0.2 s in the kernel, 0.3 s loading experts during the window
    work = {s: WorkSample(10.0, 400, 800, 2000, busy_s=0.2, service_s=0.4, cpu_s=1.0, cpu_limit=0.1, compute_cpu_s=0.2,
                          call_cpu_s=0.2, change_cpu_s=0.3 if s == "a" else 0.0) for s in ("a", "b")}
    costs = calibrate(work, SHAPE, num_layers=1)
    assert costs.cpu("a").call_s == pytest.approx(0.5 / 400) and costs.cpu("b").call_s == pytest.approx(0.8 / 400)
    # the servicer's own measure is the floor: the process's CPU cannot have spent less on the calls
    floor = calibrate({"a": replace(work["a"], change_cpu_s=0.7)}, SHAPE, num_layers=1)
    assert floor.cpu("a").call_s == pytest.approx(0.2 / 400)
