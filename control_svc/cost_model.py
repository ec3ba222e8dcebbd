"""What a placement costs per step and what a switch costs: the numbers a rebalance decision weighs.

Step model. In each MoE layer the attention replica sends one call to every expert server holding
experts its tokens are routed to, all at once, and waits for the slowest. A server's time for its
call is
    call_s (if called) + expert_s x (experts it computes) + row_s x (rows it computes) + rows x row_bytes / bandwidth
and the replica spends `fanout_s` per server it calls (encoding, sending, gathering). The expert part
of a step is therefore
    T(placement) = sum over layers [ max over servers (time) + fanout_s x (servers called) ].
Rows per step of each (layer, expert) are the window load over the steps in the window; the copies
of an expert share its rows evenly (as the attention replicas split them); a copy getting r rows a
step computes with probability 1 - e^-r and a server is called with probability 1 - e^-(its rows)
(rows arrive as a Poisson stream). The step has a second bound: the servers' CPU budgets. A
server limited to c CPUs (`cpu_limit`, its cgroup quota or pinned cores) that needs D CPU seconds a
step cannot run a step in less than D / c. D is measured for the current placement (the process's
CPU seconds over the window, per step) and scaled by the server's modelled CPU a step under another
against now: its CPU seconds per call, per expert computed and per row (`StepCosts.cpu`). Under a
quota a server's wall time is its CPU stretched by the budget: it computes at full speed while its
budget lasts and waits for the next quota period when it is spent. So the latency of a limited
server's call is its CPU (not its measured seconds, which hold the waits), and the waits are the
budget's bound D / c, counted there once. The rest of a step (attention, sampling, the router) is
the measured step time less the larger of T(current placement) and the budgets' bound: `other_s`.
It adds to either bound (while the step runs outside the expert calls the servers idle, and a quota
period's budget left unused is lost, not saved for the next call), so a placement's step time is
`other_s` + the larger of its T and its budgets' bound, and its predicted gain over the current
one is step(current) / step(new). When the mesh idled during the window the measured step time is
too long, which only makes the predicted gain smaller.

Calibration (`calibrate`) from what each expert server reports over its load window
(`WorkSample`, ExpertStats.window_work): calls, experts computed, rows, seconds computing and
seconds with a call in service, the process's CPU seconds, and of them the thread CPU seconds
inside the expert kernel and in the calls' handling outside it (each call measures both). Compute
seconds are fitted as expert_s x experts + row_s x rows over all servers (least squares, pulled
towards the priors so that little traffic cannot set them alone); each server's costs are then
scaled by its own measured / fitted compute time (a server on a smaller CPU budget is slower), and
its call_s is its in-service seconds not spent computing, per call. CPU is not fitted where it is
measured: the kernel's CPU seconds are fitted per expert computed and per row over the servers (the
same work costs the same CPU on every server), and a server's CPU per call is all its process's
CPU outside the kernel over its calls (decoding and encoding in the servicer, which it measures
apart, and the gRPC threads and the event loop around them, which only the process's CPU holds;
less the CPU of loading and dropping experts, which the server also measures apart),
so a call's fixed CPU counts once per layer a server is called and spreading hot experts spreads
calls too. Servers that report no kernel CPU are fitted as call_s x calls + expert_s x experts +
row_s x rows over all servers, which cannot tell a call's cost from its rows' where the servers'
calls and rows go together. Steps in the window: the most calls one server got over the number of MoE
layers (a server holding warm experts is called at every layer of every step); the measured step
time is that server's window over them. Without reports the priors stand (`CostPriors`, from the
model's shape), and a step is taken to carry one token.

Switch cost (`switch_cost`): the copies a switch loads (exactly the diff), their bytes, and the
seconds the loading takes (seconds per copy calibrated from the last switches' prepare phases).

Shape letters: L MoE layers, E logical experts, S servers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import torch

from moemesh.contracts.placement import Placement

MIN_SCALE, MAX_SCALE = 0.2, 5.0  # how far one server's measured speed may set it apart from the fit
PRIOR_WEIGHT = 1e-3  # how strongly the fit is pulled towards the priors (relative to the data): decides only what the data leave open


@dataclass(frozen=True)
class ServerCost:
    """Seconds one expert server spends per call, per expert it computes in a call, per row."""

    call_s: float
    expert_s: float
    row_s: float

    def scaled(self, compute: float) -> "ServerCost":
        return ServerCost(self.call_s, self.expert_s * compute, self.row_s * compute)


@dataclass(frozen=True)
class ExpertShape:
    """What the cost model needs of the model: an expert's size and what one row of it computes."""

    hidden_size: int
    intermediate_size: int
    weight_bytes: int = 2  # bytes per weight as served
    activation_bytes: int = 2  # bytes per activation on the wire
    top_k: int = 1  # the model's

    @property
    def expert_bytes(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size * self.weight_bytes

    @property
    def row_flops(self) -> int:
        return 6 * self.hidden_size * self.intermediate_size

    @property
    def row_bytes(self) -> int:
        """A row's activations out and its result back."""
        return 2 * self.hidden_size * self.activation_bytes


@dataclass(frozen=True)
class CostPriors:
    """What the model assumes before any server reported: a CPU core's rates, a loopback link."""

    call_s: float = 200e-6  # an expert server's per-call work (decode, dispatch, encode)
    fanout_s: float = 100e-6  # the attention replica's per-server work in a layer
    read_bytes_s: float = 20e9  # expert weights read per second (decode is bound by this)
    flops_s: float = 50e9  # expert MLP flops per second
    link_bytes_s: float = 2e9  # activations per second over the transport
    load_bytes_s: float = 1e9  # expert weights loaded per second during a switch

    def server(self, shape: ExpertShape) -> ServerCost:
        return ServerCost(self.call_s, shape.expert_bytes / self.read_bytes_s, shape.row_flops / self.flops_s)


@dataclass(frozen=True)
class WorkSample:
    """One expert server's work over its load window (ExpertStats.window_work)."""

    seconds: float
    requests: int
    expert_calls: int
    rows: int
    busy_s: float
    service_s: float
    cpu_s: float = 0.0  # the process's CPU seconds
    cpu_limit: float = 0.0  # CPUs it may use (0: not limited)
    compute_cpu_s: float = 0.0  # thread CPU seconds inside the expert kernel (0: not reported)
    call_cpu_s: float = 0.0  # thread CPU seconds of the calls' handling outside the kernel
    change_cpu_s: float = 0.0  # thread CPU seconds of placement changes (loading, dropping experts)


@dataclass(frozen=True)
class StepCosts:
    """The calibrated model. `steps`: steps in the load window (None: unknown, one token a step);
    `step_s`: measured seconds per step (None: unknown, nothing outside the experts)."""

    default: ServerCost
    servers: Mapping[str, ServerCost] = field(default_factory=dict)
    fanout_s: float = CostPriors.fanout_s
    row_bytes: int = 0
    link_bytes_s: float = CostPriors.link_bytes_s
    steps: float | None = None
    step_s: float | None = None
    calibrated: bool = False  # from server reports, not priors alone
    cpu_per_step: Mapping[str, float] = field(default_factory=dict)  # CPU seconds each server used per step
    cpu_limit: Mapping[str, float] = field(default_factory=dict)  # CPUs each limited server may use
    cpu_cost: ServerCost | None = None  # CPU seconds per call, expert computed, row (None: as the server's time)
    cpu_servers: Mapping[str, ServerCost] = field(default_factory=dict)  # each server's own, where measured

    def server(self, server_id: str) -> ServerCost:
        return self.servers.get(server_id, self.default)

    def cpu(self, server_id: str) -> ServerCost | None:
        """CPU seconds per call, expert computed and row of a server (None: price its CPU as its time)."""
        return self.cpu_servers.get(server_id, self.cpu_cost)


def _fit(x_rows: Sequence[Sequence[float]], y_values: Sequence[float], prior: Sequence[float]) -> list[float]:
    """Coefficients m with y = sum_j m_j x_j, least squares as multiples of the `prior`
    coefficients, pulled towards 1 with PRIOR_WEIGHT, each at least 5% of its prior."""
    p = torch.tensor(prior, dtype=torch.float64)  # [J]
    x = torch.tensor(x_rows, dtype=torch.float64) * p  # [S, J]
    y = torch.tensor(y_values, dtype=torch.float64)  # [S]
    j = x.shape[1]
    reg = PRIOR_WEIGHT * float((x * x).sum()) / j + 1e-30
    m = torch.linalg.solve(x.T @ x + reg * torch.eye(j, dtype=torch.float64), x.T @ y + reg * torch.ones(j, dtype=torch.float64))
    return (m.clamp_min(0.05) * p).tolist()


def calibrate(
    work: Mapping[str, WorkSample], shape: ExpertShape, num_layers: int, priors: CostPriors = CostPriors(), min_requests: int = 20
) -> StepCosts:
    """The model from the servers' window reports (servers with fewer than `min_requests` calls
    keep the defaults). See the module docstring."""
    base = StepCosts(priors.server(shape), fanout_s=priors.fanout_s, row_bytes=shape.row_bytes, link_bytes_s=priors.link_bytes_s)
    seen = {sid: w for sid, w in work.items() if w.requests >= min_requests and w.busy_s > 0 and w.seconds > 0}
    if not seen:
        return base
    expert_s, row_s = _fit([[w.expert_calls, w.rows] for w in seen.values()], [w.busy_s for w in seen.values()],
                           [base.default.expert_s, base.default.row_s])
    fitted = ServerCost(base.default.call_s, expert_s, row_s)
    servers = {}
    for sid, w in seen.items():
        predicted = expert_s * w.expert_calls + row_s * w.rows
        scale = min(MAX_SCALE, max(MIN_SCALE, w.busy_s / predicted)) if predicted > 0 else 1.0
        call_s = max(0.0, w.service_s - w.busy_s) / w.requests
        servers[sid] = replace(fitted.scaled(scale), call_s=call_s)
    typical = sorted(servers.values(), key=lambda c: c.row_s)[len(servers) // 2]
    busiest = max(seen.values(), key=lambda w: w.requests)
    steps = busiest.requests / max(1, num_layers)
    cpu = {sid: w.cpu_s / steps for sid, w in seen.items() if w.cpu_s > 0}
    limits = {sid: w.cpu_limit for sid, w in work.items() if w.cpu_limit > 0}
    cpu_cost, cpu_servers = _cpu_costs({sid: w for sid, w in seen.items() if w.cpu_s > 0}, base.default)
    return replace(base, default=typical, servers=servers, steps=steps, step_s=busiest.seconds / steps, calibrated=True,
                   cpu_per_step=cpu, cpu_limit=limits, cpu_cost=cpu_cost, cpu_servers=cpu_servers)


def _cpu_costs(used: Mapping[str, WorkSample], prior: ServerCost) -> tuple[ServerCost | None, dict[str, ServerCost]]:
    """(the typical server's CPU costs, each server's) from the servers that reported CPU seconds.
    Where a server measured its kernel's CPU apart, the kernel's CPU is fitted per expert computed
    and per row over those servers (the same work costs the same CPU on every server: a budget
    limits its rate, not its cost), and the rest of its process's CPU (decoding, encoding, the
    gRPC threads, the event loop: everything the kernel does not do, less the CPU its placement
    changes took) is its own per-call cost, measured, not fitted. Servers that did not report the split are fitted as calls, experts and
    rows together (which cannot tell a call's cost from its rows' where the servers' calls and
    rows go together)."""
    if not used:
        return None, {}
    split = {sid: w for sid, w in used.items() if w.compute_cpu_s > 0}
    if not split:
        return ServerCost(*_fit([[w.requests, w.expert_calls, w.rows] for w in used.values()], [w.cpu_s for w in used.values()],
                                [prior.call_s, prior.expert_s, prior.row_s])), {}
    expert_s, row_s = _fit([[w.expert_calls, w.rows] for w in split.values()], [w.compute_cpu_s for w in split.values()],
                           [prior.expert_s, prior.row_s])
    servers = {sid: ServerCost(max(w.call_cpu_s, w.cpu_s - w.compute_cpu_s - w.change_cpu_s) / w.requests, expert_s, row_s)
               for sid, w in split.items()}
    return sorted(servers.values(), key=lambda c: c.call_s)[len(servers) // 2], servers


# ---- step time of a placement -------------------------------------------------------------------
def rows_per_step(load, costs: StepCosts, top_k: int) -> torch.Tensor:
    """[L, E] rows each (layer, expert) gets per step: the window load over the window's steps
    (without them, as if each step carried one token: `top_k` rows per layer)."""
    w = torch.as_tensor(load, dtype=torch.float64)
    if costs.steps:
        return w / costs.steps
    per_layer = w.sum(dim=1, keepdim=True).clamp_min(1e-12)
    return w / per_layer * top_k


def _expert_times(rows, placement: Placement, layers: Sequence[int], costs: StepCosts) -> tuple[float, dict[str, float]]:
    """(T(placement), each server's modelled CPU seconds a step): `rows` [L, E] per step. A server's
    CPU is priced with `costs.cpu_cost` (without it, as its time)."""
    r = torch.as_tensor(rows, dtype=torch.float64)
    total = 0.0
    cpu_per_step: dict[str, float] = {}
    for i, layer in enumerate(layers):
        per_server: dict[str, list[float]] = {}  # server -> [rows, experts computed]
        for e, holders in enumerate(placement.replicas[layer]):
            share = float(r[i, e]) / len(holders)
            touched = -math.expm1(-share)
            for s in holders:
                acc = per_server.setdefault(s, [0.0, 0.0])
                acc[0] += share
                acc[1] += touched
        slowest, called = 0.0, 0.0
        for s, (n, g) in per_server.items():
            c = costs.server(s)
            p = -math.expm1(-n)
            called += p
            transfer = n * costs.row_bytes / costs.link_bytes_s
            t = p * c.call_s + g * c.expert_s + n * c.row_s + transfer
            u = costs.cpu(s)
            cpu = t if u is None else p * u.call_s + g * u.expert_s + n * u.row_s
            if u is not None and s in costs.cpu_limit:
                # a server under a CPU budget computes at full speed while its budget lasts: its call
                # takes its CPU; the waits for the next quota period (the stretch of its wall time
                # that its measured seconds hold) are the budget's bound on the step, counted there once
                t = cpu + transfer
            cpu_per_step[s] = cpu_per_step.get(s, 0.0) + cpu
            slowest = max(slowest, t)
        total += slowest + costs.fanout_s * called
    return total, cpu_per_step


def expert_seconds(rows, placement: Placement, layers: Sequence[int], costs: StepCosts) -> float:
    """T(placement): seconds of a step spent on the experts, `rows` [L, E] per step (rows of
    `layers`). See the module docstring."""
    return _expert_times(rows, placement, layers, costs)[0]


@dataclass(frozen=True)
class Prediction:
    """Seconds per step now and with the change, and their ratio (> 1: faster)."""

    step_s_before: float
    step_s_after: float
    other_s: float  # the part of a step outside the expert calls
    budget_bound: bool = False  # the step after is held to a server's CPU budget, not its latency

    @property
    def gain(self) -> float:
        return self.step_s_before / self.step_s_after if self.step_s_after > 0 else 1.0


def _budget_step(modelled: dict[str, float], current: dict[str, float], costs: StepCosts) -> float:
    """The shortest step the CPU-limited servers allow: each server's CPU a step (measured now,
    scaled by its modelled CPU a step under the placement against now) over its CPUs."""
    bound = 0.0
    for s, limit in costs.cpu_limit.items():
        t = modelled.get(s, 0.0)
        cpu = costs.cpu_per_step.get(s)
        if cpu is None or t <= 0:
            continue
        now = current.get(s, 0.0)
        bound = max(bound, (cpu * t / now if now > 0 else t) / limit)
    return bound


def predict(rows_before, placement_before: Placement, rows_after, placement_after: Placement, layers: Sequence[int],
            costs: StepCosts) -> Prediction:
    """A step under `placement_after` with `rows_after` [L, E] against the current one: the larger
    of its latency and the bound of the servers' CPU budgets (module docstring)."""
    before, before_per_server = _expert_times(rows_before, placement_before, layers, costs)
    after, after_per_server = _expert_times(rows_after, placement_after, layers, costs)
    budget_before = _budget_step(before_per_server, before_per_server, costs)
    budget_after = _budget_step(after_per_server, before_per_server, costs)
    # the rest of the step: what neither the expert calls' latency nor a CPU budget explains. It
    # adds to either: while the step runs outside the expert calls the servers wait, and a quota
    # period's budget left unused then is lost, not saved for the calls
    other = max(0.0, costs.step_s - max(before, budget_before)) if costs.step_s else 0.0
    return Prediction(other + max(before, budget_before), other + max(after, budget_after), other, budget_after > after)


# ---- what a switch costs ------------------------------------------------------------------------
@dataclass(frozen=True)
class SwitchCost:
    copies: int  # expert copies the prepare phase loads
    bytes: int
    seconds: float  # loading them (on the servers, side by side with serving)


def switch_cost(copies: int, shape: ExpertShape, seconds_per_copy: float | None, priors: CostPriors = CostPriors()) -> SwitchCost:
    """`copies` loaded; `seconds_per_copy` as measured in the last switches (None: the prior rate)."""
    per_copy = shape.expert_bytes / priors.load_bytes_s if seconds_per_copy is None else seconds_per_copy
    return SwitchCost(copies, copies * shape.expert_bytes, copies * per_copy)
