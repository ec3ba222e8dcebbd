"""Expert placement as pure functions (EPLB's shape): what the control plane switches to, and what it costs.

- `initial_placement`: one copy of every expert, round robin within the servers' slot budgets;
- `solve`: from observed load to the next placement, moving as little as it can (below);
- `plan_rebalance`: the one rebalance decision: solve, price the candidates with the step and switch
  cost model (`cost_model`), then switch only when `RebalancePolicy` says the predicted gain is worth
  the switch;
- `evacuate`: a placement without a leaving server;
- `placement_diff`: the copies a switch loads and drops; `balancedness` / `server_loads` score a
  placement under a load.

`solve` = `replicate` (copies per expert) + laying the copies onto servers, per layer
(`placement_packing`). The balance cost of a layer is its peak server load (every MoE layer waits
for its slowest server); the movement cost is the number of copies a server must load that it does
not hold now. Per layer the candidates are: a fresh packing that sticks to servers already holding
an expert when that costs at most `tolerance * mean server load`; the incremental path from the
current copies (every intermediate state); the current layer itself, when still valid. With
`num_physical` left to the solver, the candidates of both copy counts it tries compete. Among the
candidates whose peak is within `(1 + tolerance)` of the best, it takes the one that moves fewest
copies (then the lower peak): a small load drift moves nothing, a real skew moves only what is
needed to come within `tolerance` of the best balance found. The pass is repeated from its own
result (at most `POLISH_ROUNDS` more times, until nothing changes), so a solution is a fixed point:
solving again with the same load returns it unchanged.

Shape letters: L layers, E logical experts, P copies per layer, S servers.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from control_svc.cost_model import (
    CostPriors, ExpertShape, Prediction, StepCosts, SwitchCost, calibrate, predict, rows_per_step, switch_cost,
)
from control_svc.placement_packing import as_load, incremental, pack, replicate, slot_capacity
from moemesh.contracts.placement import LayerExperts, Placement

Row = tuple[tuple[str, ...], ...]
POLISH_ROUNDS = 2  # extra passes from the pass's own result, until it stops changing


@dataclass(frozen=True)
class ServerBudget:
    """One expert server as the solver sees it: at most `slots` experts of every MoE layer (expert
    weights are the same size in every layer, so a per-layer budget is the server's expert memory)."""

    server_id: str
    slots: int

    def __post_init__(self) -> None:
        if not isinstance(self.server_id, str) or not self.server_id:
            raise ValueError(f"server_id must be a non-empty string, got {self.server_id!r}")
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 0:
            raise ValueError(f"slots of server {self.server_id!r} must be an int >= 0, got {self.slots!r}")

    @classmethod
    def from_total(cls, server_id: str, total_slots: int, num_layers: int, num_experts: int) -> "ServerBudget":
        """From an expert server's total budget of (layer, expert) copies (its `--slot-budget`;
        0 = no limit): `total_slots // num_layers` per layer, at most `num_experts`."""
        if isinstance(total_slots, bool) or not isinstance(total_slots, int) or total_slots < 0:
            raise ValueError(f"total_slots of server {server_id!r} must be an int >= 0, got {total_slots!r}")
        if num_layers < 1 or num_experts < 1:
            raise ValueError(f"num_layers and num_experts must be >= 1, got {num_layers}, {num_experts}")
        per_layer = num_experts if total_slots == 0 else min(total_slots // num_layers, num_experts)
        return cls(server_id, per_layer)


# ---- the first placement, and one without a leaving server --------------------------------------
def initial_placement(layers: Sequence[int], num_experts: int, servers: Sequence[tuple[str, int]], version: int) -> Placement:
    """servers: (server id, total slot budget; 0 = no limit). Walks (layer, expert) pairs in order
    and hands each to the next server in rotation that still has a free slot, so every server ends
    up with ceil or floor of L*E / S experts when budgets allow, and each layer's experts are spread."""
    if not servers:
        raise ValueError("servers: at least one expert server is needed to place experts")
    if num_experts <= 0 or not layers:
        raise ValueError(f"nothing to place: layers {list(layers)}, num_experts {num_experts}")
    need = len(layers) * num_experts
    if all(budget > 0 for _, budget in servers) and sum(b for _, b in servers) < need:
        raise ValueError(
            f"slot_budget: the servers offer {sum(b for _, b in servers)} slots, {need} (layer, expert) pairs need one each"
        )
    used = {sid: 0 for sid, _ in servers}
    budget = dict(servers)
    turn = 0
    replicas: dict[int, Row] = {}
    for layer in layers:
        owners = []
        for _ in range(num_experts):
            for step in range(len(servers)):
                sid = servers[(turn + step) % len(servers)][0]
                if budget[sid] == 0 or used[sid] < budget[sid]:
                    break
            used[sid] += 1
            owners.append((sid,))
            turn = (turn + step + 1) % len(servers)
        replicas[layer] = tuple(owners)
    return Placement(version=version, replicas=replicas)


def evacuate(p: Placement, leaving: str, servers: Sequence[tuple[str, int]], version: int) -> Placement:
    """Placement `version` without `leaving`: a copy whose expert has other copies is dropped, a sole
    copy moves to the server with the fewest copies that has a free slot and lacks that expert.
    servers: (id, total slot budget; 0 = no limit) that may take copies. ValueError when they lack slots."""
    targets = [(sid, budget) for sid, budget in servers if sid != leaving]
    load = Counter({sid: 0 for sid, _ in targets})
    for experts in p.replicas.values():
        for copies in experts:
            load.update(s for s in copies if s in load)
    budget = dict(targets)
    replicas: dict[int, Row] = {}
    for layer in p.layers:
        out = []
        for e, copies in enumerate(p.replicas[layer]):
            rest = tuple(s for s in copies if s != leaving)
            if not rest:
                free = [s for s, _ in targets if (budget[s] == 0 or load[s] < budget[s]) and s not in copies]
                if not free:
                    raise ValueError(f"slot_budget: no server has a free slot for layer {layer} expert {e} of leaving server {leaving}")
                target = min(free, key=lambda s: (load[s], s))
                load[target] += 1
                rest = (target,)
            out.append(rest)
        replicas[layer] = tuple(out)
    return Placement(version=version, replicas=replicas)


# ---- what a switch costs, and how balanced a placement is ---------------------------------------
@dataclass(frozen=True)
class PlacementDiff:
    """`loads[server][layer]` = experts the server must load (prepare); `drops` likewise (release)."""

    loads: dict[str, LayerExperts]
    drops: dict[str, LayerExperts]

    @property
    def moves(self) -> int:
        """Expert copies to load (the cost of a switch: each is read from the checkpoint)."""
        return sum(len(es) for layers in self.loads.values() for es in layers.values())


def placement_diff(old: Placement, new: Placement) -> PlacementDiff:
    """Copies in `new` but not in `old` (loads) and in `old` but not in `new` (drops)."""

    def copies(p: Placement) -> set[tuple[str, int, int]]:
        return {(s, layer, e) for layer, experts in p.replicas.items() for e, cs in enumerate(experts) for s in cs}

    def group(items: set[tuple[str, int, int]]) -> dict[str, LayerExperts]:
        out: dict[str, dict[int, list[int]]] = {}
        for s, layer, e in items:
            out.setdefault(s, {}).setdefault(layer, []).append(e)
        return {s: {l: tuple(sorted(es)) for l, es in sorted(ls.items())} for s, ls in sorted(out.items())}

    before, after = copies(old), copies(new)
    return PlacementDiff(loads=group(after - before), drops=group(before - after))


def _ids(servers: Sequence[str | ServerBudget] | None, placement: Placement) -> list[str]:
    if servers is None:
        return list(placement.servers())
    return [s.server_id if isinstance(s, ServerBudget) else s for s in servers]


def server_loads(
    load, placement: Placement, servers: Sequence[str | ServerBudget] | None = None, layer_ids: Sequence[int] | None = None
) -> torch.Tensor:
    """Per-server load `[L,S]` (float64): each expert's load `load[L,E]` is shared evenly by its copies.

    Row l of `load` is placement layer `layer_ids[l]` (default `placement.layers`). `servers` fixes
    the columns (default `placement.servers()`); copies on servers outside it are ignored.
    """
    w = as_load(load)
    layers = list(placement.layers if layer_ids is None else layer_ids)
    if len(layers) != w.shape[0]:
        raise ValueError(f"load has {w.shape[0]} layers, placement/layer_ids name {len(layers)}")
    ids = _ids(servers, placement)
    col = {s: i for i, s in enumerate(ids)}
    out = torch.zeros(w.shape[0], len(ids), dtype=torch.float64)
    for row, layer in enumerate(layers):
        experts = placement.replicas.get(layer)
        if experts is None or len(experts) != w.shape[1]:
            raise ValueError(f"placement layer {layer} must list {w.shape[1]} experts")
        for e, copies in enumerate(experts):
            share = float(w[row, e]) / len(copies)
            for s in copies:
                if s in col:
                    out[row, col[s]] += share
    return out


def balancedness(
    load, placement: Placement, servers: Sequence[str | ServerBudget] | None = None, layer_ids: Sequence[int] | None = None
) -> float:
    """Mean over layers of (mean per-server load / max per-server load), in (0, 1]; 1 is perfect.
    Every MoE layer waits for its slowest server, so each layer is scored on its own; a layer with
    no load scores 1. Arguments as in `server_loads`."""
    per_server = server_loads(load, placement, servers, layer_ids)
    if per_server.shape[1] == 0:
        raise ValueError("servers must name at least one server")
    peak = per_server.max(dim=1).values
    ratio = torch.where(peak > 0, per_server.mean(dim=1) / peak.clamp_min(1e-300), torch.ones_like(peak))
    return float(ratio.mean())


# ---- the solver ---------------------------------------------------------------------------------
def _check_servers(servers: Sequence[ServerBudget]) -> None:
    if not servers:
        raise ValueError("servers must list at least one ServerBudget")
    if not all(isinstance(s, ServerBudget) for s in servers):
        raise ValueError(f"servers must hold ServerBudget values, got {list(servers)!r}")
    ids = [s.server_id for s in servers]
    if len(set(ids)) != len(ids):
        raise ValueError(f"servers must have unique server_id values, got {ids}")


def _row_valid(row: Row, servers: Sequence[ServerBudget], num_experts: int, totals: Sequence[int]) -> bool:
    """Every expert has a copy, only on `servers`, each within its slots, never twice on a server,
    and the row has one of the copy counts tried."""
    if len(row) != num_experts:
        return False
    slots = {s.server_id: s.slots for s in servers}
    used: Counter[str] = Counter()
    for copies in row:
        if not copies or len(set(copies)) != len(copies) or any(s not in slots for s in copies):
            return False
        used.update(copies)
    return sum(used.values()) in totals and all(n <= slots[s] for s, n in used.items())


def _row(groups: torch.Tensor, assignment: torch.Tensor, old: Row | None, ids: list[str], num_experts: int) -> Row:
    """Placement row from copy p of expert `groups[p]` on server `ids[assignment[p]]`; copies that
    stay keep their order, new ones follow in `ids` order."""
    on: list[set[str]] = [set() for _ in range(num_experts)]
    for e, s in zip(groups.tolist(), assignment.tolist()):
        on[e].add(ids[s])
    before = old if old is not None and len(old) == num_experts else ((),) * num_experts
    rows = []
    for e in range(num_experts):
        kept = [s for s in before[e] if s in on[e]]
        rows.append(tuple(kept + [s for s in ids if s in on[e] and s not in kept]))
    return tuple(rows)


def _solve_rows(
    w: torch.Tensor, servers: Sequence[ServerBudget], totals: Sequence[int], old_rows: list[Row | None], tolerance: float
) -> list[Row]:
    """One pass of the rule in the module docstring over every layer: `w[L,E]`, `old_rows[L]`."""
    num_layers, num_experts = w.shape
    ids = [s.server_id for s in servers]
    slots = [s.slots for s in servers]
    budget = torch.as_tensor(slots, dtype=torch.int64)
    held = torch.zeros(num_layers, num_experts, len(servers), dtype=torch.bool)  # [L,E,S]
    col = {s: i for i, s in enumerate(ids)}
    for row_i, row in enumerate(old_rows):
        if row is not None and len(row) == num_experts:
            for e, copies in enumerate(row):
                for s in copies:
                    if s in col:
                        held[row_i, e, col[s]] = True

    # (peak server load, copies moved, row builder) per layer, over every copy count tried
    options: list[list[tuple[float, int, Callable[[], Row]]]] = [[] for _ in range(num_layers)]
    for p in totals:
        phy2log, _, logcnt = replicate(w, p, slots)  # [L,P], _, [L,E]
        weights = w.gather(1, phy2log) / logcnt.gather(1, phy2log)  # [L,P]
        fresh = pack(weights, len(servers), slots, groups=phy2log, held=held, tolerance=tolerance)  # [L,P]
        for row_i in range(num_layers):
            hl = held[row_i]
            for g, a in [(phy2log[row_i], fresh[row_i]), *incremental(w[row_i], phy2log[row_i], hl, budget, max_steps=p)]:
                wt = w[row_i, g] / torch.bincount(g, minlength=num_experts)[g]
                peak = float(torch.zeros(len(servers), dtype=torch.float64).index_add_(0, a, wt).max())
                build = lambda g=g, a=a, old=old_rows[row_i]: _row(g, a, old, ids, num_experts)  # noqa: E731
                options[row_i].append((peak, int((~hl[g, a]).sum()), build))
    out: list[Row] = []
    for row_i, old in enumerate(old_rows):
        if old is not None and _row_valid(old, servers, num_experts, totals):
            peak = float(server_loads(w[row_i], Placement(version=0, replicas={0: old}), ids, [0]).max())
            options[row_i].append((peak, 0, lambda old=old: old))
        limit = (1 + tolerance) * min(o[0] for o in options[row_i])
        out.append(min((o for o in options[row_i] if o[0] <= limit), key=lambda o: (o[1], o[0]))[2]())
    return out


def solve(
    load,
    servers: Sequence[ServerBudget],
    num_physical: int | None = None,
    current: Placement | None = None,
    *,
    layer_ids: Sequence[int] | None = None,
    tolerance: float = 0.05,
) -> Placement:
    """The next placement for expert load `load[L,E]` (token counts per layer and logical expert).

    servers: the expert servers and their per-layer slot budgets.  num_physical: P, the total
    copies per layer (E <= P). By default each layer gets whichever is better of one copy per
    expert (P = E) and every slot the servers have (up to one copy of an expert per server):
    with uneven budgets, filling every slot can force copies onto the big server that add to its
    load, so the solver compares both (the current layer is kept if its copy count is either).
    current: the placement in force.  layer_ids: the placement layer of each row of `load`
    (default 0..L-1); layers of `current` not named there are carried over unchanged.
    tolerance: relative balance cost accepted to avoid a move (>= 0).

    Returns `current` itself when nothing changes, else a Placement with version
    `current.version + 1` (0 without `current`). ValueError names the field when the budgets
    cannot hold every expert or P copies.
    """
    w = as_load(load)
    num_layers, num_experts = w.shape
    _check_servers(servers)
    slots = [s.slots for s in servers]
    capacity = int(slot_capacity(slots, num_experts)[-1])
    if capacity < num_experts:
        raise ValueError(f"servers: slot budgets {slots} hold {capacity} distinct experts per layer, need {num_experts}")
    if num_physical is None:
        totals = sorted({num_experts, capacity})
    elif isinstance(num_physical, bool) or not isinstance(num_physical, int) or not num_experts <= num_physical <= capacity:
        raise ValueError(f"num_physical must be an int in [{num_experts}, {capacity}] for these servers, got {num_physical!r}")
    else:
        totals = [num_physical]
    layers = list(range(num_layers)) if layer_ids is None else list(layer_ids)
    if len(layers) != num_layers or len(set(layers)) != num_layers:
        raise ValueError(f"layer_ids must name {num_layers} distinct layers, got {layer_ids!r}")
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance!r}")

    rows = [current.replicas.get(layer) if current is not None else None for layer in layers]
    todo = list(range(num_layers))
    for _ in range(1 + POLISH_ROUNDS):  # re-solve the layers the last pass changed
        solved = _solve_rows(w[todo], servers, totals, [rows[i] for i in todo], tolerance)
        changed = [i for i, row in zip(todo, solved) if row != rows[i]]
        for i, row in zip(todo, solved):
            rows[i] = row
        if not changed:
            break
        todo = changed
    new = dict(zip(layers, rows))
    if current is None:
        return Placement(version=0, replicas=new)
    merged = {**current.replicas, **new}
    if merged == current.replicas:
        return current
    return Placement(version=current.version + 1, replicas=merged)


# ---- when a rebalance is worth it ---------------------------------------------------------------
@dataclass(frozen=True)
class RebalancePolicy:
    """min_gain: how much faster a step must be predicted to become (0.05: 5%) for a switch.
    payback_s: the switch's own cost (the seconds its loading takes) must be won back by the faster
    steps within this many seconds of serving.
    min_tokens: fewer tokens than this in the window is noise: no decision.
    max_moves: most expert copies one switch may load (0 = no limit); above it, no switch.
    tolerance: passed to `solve` (balance traded for fewer moves)."""

    min_gain: float = 0.05
    payback_s: float = 60.0
    min_tokens: int = 10_000
    max_moves: int = 0
    tolerance: float = 0.05

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_gain <= 1.0:
            raise ValueError(f"min_gain must be in [0, 1], got {self.min_gain!r}")
        if not self.payback_s > 0:
            raise ValueError(f"payback_s must be > 0, got {self.payback_s!r}")
        for name in ("min_tokens", "max_moves"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not self.tolerance >= 0:
            raise ValueError(f"tolerance must be >= 0, got {self.tolerance!r}")

    def refusal(self, prediction: Prediction, switch: SwitchCost) -> str:
        """Why a switch with this predicted step time and cost is not worth it ("" when it is)."""
        if prediction.gain < 1 + self.min_gain:
            return f"predicted gain {prediction.gain:.3f}x is below 1 + min_gain {self.min_gain}"
        if self.max_moves and switch.copies > self.max_moves:
            return f"{switch.copies} moves exceed max_moves {self.max_moves}"
        saved = 1 - 1 / prediction.gain  # of every second served
        if switch.seconds > self.payback_s * saved:
            return (f"loading {switch.copies} copies ({switch.seconds:.2f}s) is not won back within payback_s "
                    f"{self.payback_s:g} at a {saved:.1%} saving")
        return ""


@dataclass(frozen=True)
class CostInputs:
    """What `plan_rebalance` prices placements with: the calibrated step model, the expert's shape,
    the routing top-k in force, the measured seconds to load one copy (None: the prior rate)."""

    costs: StepCosts
    shape: ExpertShape
    top_k: int = 1
    seconds_per_copy: float | None = None

    @classmethod
    def from_priors(cls, shape: ExpertShape = ExpertShape(1024, 512, top_k=2), priors: CostPriors = CostPriors()) -> "CostInputs":
        """Priors only: before any server reported (a mid-sized bf16 expert by default)."""
        return cls(calibrate({}, shape, 1, priors), shape, shape.top_k)


@dataclass(frozen=True)
class RebalancePlan:
    placement: Placement | None  # None: keep the current placement (`reason` says why)
    before: float  # balancedness of the current placement under the load
    after: float  # balancedness of the planned placement (== before when nothing was planned)
    moves: int  # expert copies the switch loads
    tokens: int  # tokens in the load window
    reason: str = ""
    prediction: Prediction | None = None  # step time now and with the plan (None: nothing was solved)
    switch: SwitchCost | None = None  # what loading the plan's new copies costs


def plan_rebalance(
    load: torch.Tensor,
    budgets: Sequence[ServerBudget],
    current: Placement,
    layers: Sequence[int],
    policy: RebalancePolicy,
    num_physical: int | None = None,
    force: bool = False,
    prior: int = 0,
    cost: CostInputs | None = None,
) -> RebalancePlan:
    """load [L, E] (rows = `layers`); the solver sees `load + prior` (a prior of a few tokens per
    expert spreads experts even where nothing was observed).

    Candidates: the solver's placement for `num_physical` copies per layer (None: left to the
    solver), and its placement with one copy per expert (no replicas), so that the cost model, not
    the token balance alone, decides whether replicas pay. Each is priced by `cost` (the step model
    and the switch's cost, `control_svc.cost_model`); the one predicted fastest is planned when the
    policy accepts it (`RebalancePolicy.refusal`: the margin, max_moves, the payback). Unforced, a
    plan also needs `policy.min_tokens` tokens; forced, the fastest candidate that changes the
    placement is planned. A current placement naming servers outside `budgets` (dead or leaving) is
    always re-solved."""
    cost = cost or CostInputs.from_priors()
    ids = [b.server_id for b in budgets]
    tokens = int(load.sum())
    load = load + prior
    before = balancedness(load, current, ids, layers)
    lost = [s for s in current.servers() if s not in ids]
    if not force and not lost and tokens < policy.min_tokens:
        return RebalancePlan(None, before, before, 0, tokens, f"{tokens} tokens in the load window, fewer than min_tokens {policy.min_tokens}")
    options = [num_physical] + ([load.shape[1]] if num_physical != load.shape[1] else [])
    candidates: list[Placement] = []
    for p in options:
        new = solve(load, budgets, p, current, layer_ids=list(layers), tolerance=policy.tolerance)
        if new is not current and all(new.replicas != c.replicas for c in candidates):
            candidates.append(new)
    if not candidates:
        return RebalancePlan(None, before, before, 0, tokens, "the solver keeps the current placement")
    rows = rows_per_step(load, cost.costs, cost.top_k)
    priced = []
    for new in candidates:
        prediction = predict(rows, current, rows, new, layers, cost.costs)
        switch = switch_cost(placement_diff(current, new).moves, cost.shape, cost.seconds_per_copy)
        priced.append((prediction, switch, new))
    prediction, switch, new = min(priced, key=lambda c: (-c[0].gain, c[1].copies))
    if not force and not lost and prediction.gain <= 1.0:
        return RebalancePlan(None, before, before, 0, tokens, f"no candidate is predicted faster (the best: {prediction.gain:.3f}x)", prediction)
    after = balancedness(load, new, ids, layers)
    if not force and not lost:
        why = policy.refusal(prediction, switch)
        if why:
            return RebalancePlan(None, before, after, switch.copies, tokens, why, prediction, switch)
    return RebalancePlan(new, before, after, switch.copies, tokens, "", prediction, switch)
