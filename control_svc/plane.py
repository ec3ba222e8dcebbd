"""`ControlPlane`: registry + placement board + switch, and when to change the placement.

- initial: once `expected_expert_servers` servers serve and no placement exists, the initial
  placement (round robin within slot budgets) goes through prepare -> commit -> release as v1;
- rebalance: on request or every `rebalance_interval_s`, the solver's placement for the servers'
  window load is switched in when the policy says it is worth it (`placement.plan_rebalance`,
  priced by the cost model calibrated from the servers' window work, `cost_model.calibrate`); a
  dry run plans and prices without switching;
- knobs: top-k / capacity changes are a new version with the same replicas and new knobs (their
  predicted effect on the step time comes with them);
- join: a server registering after the initial placement gets experts (a forced rebalance);
- drain: a draining server's experts move to the others before it leaves; undrain: it serves
  again and a forced rebalance gives it experts back;
- failover: a server that misses heartbeats for `dead_after_s`, or that an attention replica
  reports unreachable and that then fails a probe, is declared dead; its copies with replicas
  elsewhere are dropped from the placement, its sole copies move to the others (evacuate);
- restart: a restarted control plane starts without placement; when expert servers re-register
  saying they have run one (a reported version > 0), the first placement is rebuilt from the experts
  they hold (`recovery.rebuild_placement`) once `expected_expert_servers` are back, or
  `recovery_wait_s` after the first came back. Every version is numbered above every version a
  server or replica reported (`floor`); a replica reporting a version this plane has already reached
  (it ran a placement from before the restart) gets the committed placement again under a higher
  number, so it adopts it.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import grpc
import torch

from control_svc.board import PlacementBoard, PlacementView
from control_svc.config import ControlConfig
from control_svc.cost_model import ExpertShape, Prediction, WorkSample, calibrate, predict, rows_per_step
from control_svc.load import bounded_stats, window_load, work_sample
from control_svc.placement import (
    CostInputs, RebalancePlan, ServerBudget, balancedness, evacuate, initial_placement, plan_rebalance,
)
from control_svc.recovery import RestartMemory, check_held, rebuild_placement
from control_svc.registry import Registry
from control_svc.switch import ExpertServerOps, PlacementSwitch
from control_svc.work_history import WorkHistory
from moemesh.contracts.info import ServerInfo
from moemesh.contracts.knobs import MoeKnobs, check_change
from moemesh.contracts.placement import LayerExperts
from moemesh.errors import MeshError, invalid
from moemesh.telemetry import ServiceMetrics

log = logging.getLogger(__name__)
PLANNER_NICENESS = 10  # how much lower the solver thread's CPU priority is


def lower_priority() -> None:
    """Lower this thread's CPU priority by PLANNER_NICENESS (Linux: niceness is per thread)."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + PLANNER_NICENESS))
    except (AttributeError, OSError):  # no per-thread priority here: the solver runs at the normal one
        pass


class ControlPlane:
    def __init__(
        self,
        moe_layers: tuple[int, ...],
        num_experts: int,
        cfg: ControlConfig,
        ops: ExpertServerOps,
        registry: Registry | None = None,
        metrics: ServiceMetrics | None = None,
        shape: ExpertShape | None = None,
    ):
        """shape: the model's expert (sizes, top-k) for the cost model (default: a mid-sized one)."""
        self.moe_layers = moe_layers
        self.shape = shape or CostInputs.from_priors().shape
        self.seconds_per_copy: float | None = None  # loading one expert copy, from the last prepare phases
        self.history = WorkHistory()  # the expert servers' earlier load windows (the cost model's per-row call CPU)
        self.num_experts = num_experts
        self.cfg = cfg
        self.expected = cfg.expected_expert_servers
        self.heartbeat_interval_s = cfg.heartbeat_interval_s
        self.dead_after_s = cfg.dead_after_s
        self.policy = cfg.policy()
        self.ops = ops
        self.registry = registry or Registry()
        self.metrics = metrics
        self.board = PlacementBoard()
        self.switch = PlacementSwitch(
            ops,
            self.board,
            lambda: {s.server_id: s for s in self.registry.servers()},
            lambda: [r.adopted_version for r in self.registry.live_attention()],
            cfg.prepare_timeout_s,
            cfg.release_timeout_s,
            lambda: self.memory.floor,
            self._loaded,
        )
        self.memory = RestartMemory()  # versions and knobs from before a restart of this plane
        # the solver's thread, at a lower CPU priority: on a shared machine a plan takes idle CPU, not serving's
        self._planning = ThreadPoolExecutor(1, thread_name_prefix="planner", initializer=lower_priority)
        self._initial: asyncio.Task | None = None
        self._recovery_timer: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # placement changes running in the background
        self.moving: set[str] = set()  # draining servers whose experts are being moved away

    # ---- registration ------------------------------------------------------------------------
    def register_expert(self, info: ServerInfo, held: LayerExperts | None = None, reported_version: int = 0,
                        instance: str = "") -> ServerInfo:
        """Register an expert server; `held` and `reported_version`: the experts it holds and the
        newest placement version it has heard of (a server re-registering after a control plane
        restart); `instance`: the token its heartbeats carry. MeshError INVALID_ARGUMENT for a bad
        address or held experts the model lacks."""
        try:
            check_held(held or {}, self.moe_layers, self.num_experts)
        except ValueError as e:
            raise invalid(str(e)) from e
        # a server registering from the address of one we think alive is its restart (only one process
        # can listen there): the old one is gone, its experts fail over now rather than after dead_after_s
        for old in [r.info.server_id for r in self.registry.experts.values() if r.info.address == info.address and r.info.state != "dead"]:
            self.declare_dead(old, f"a new server registered from its address {info.address}")
        rec = self.registry.register_expert(info, held, reported_version, instance)
        self.history.forget(rec.server_id)  # a new process: the earlier windows were another's
        log.info("expert server %s registered at %s (%s)%s", rec.server_id, rec.address, rec.device,
                 f", holding experts of placement v{reported_version}" if reported_version else "")
        self.note_version(reported_version)
        if self.board.version == 0:
            if len(self.registry.serving()) >= self.expected:
                self._start_initial()
            elif self.memory.restarted and self._recovery_timer is None:
                self._recovery_timer = asyncio.get_running_loop().create_task(self._recover_after(self.cfg.recovery_wait_s))
        else:
            self._background(self.rebalance(force=True), f"placing experts on new server {rec.server_id}", lambda: None)
        return rec

    def register_attention(self, address: str, seen_version: int = 0, instance: str = "", knobs: MoeKnobs | None = None) -> str:
        """Register an attention replica that has received placements up to `seen_version` (0: none),
        the newest carrying `knobs`. MeshError INVALID_ARGUMENT for knobs that do not fit the model."""
        if knobs is not None:
            self.check_knob_set(knobs)
        replica_id = self.registry.register_attention(address, instance)
        self.note_version(seen_version, at_least=True)
        if knobs is not None and seen_version > 0:
            self._inherit_knobs(seen_version, knobs)
        return replica_id

    def _start_initial(self) -> None:
        if self._initial is None:
            self._initial = asyncio.get_running_loop().create_task(self.place_initial())

    async def place_initial(self) -> None:
        """The first placement: round robin over the serving servers, or, after a restart, the one
        their held experts make up (`rebuild_placement`); numbered above every reported version."""
        serving = self.registry.serving()
        try:
            knobs = None
            if self.memory.restarted:
                held = {s.server_id: self.registry.experts[s.server_id].held for s in serving}
                placement = rebuild_placement(self.moe_layers, self.num_experts, held, {s.server_id: s.slot_budget for s in serving}, 0)
                knobs = self.memory.inherited_knobs()
            else:
                placement = initial_placement(self.moe_layers, self.num_experts, [(s.server_id, s.slot_budget) for s in serving], 0)
            view = await self.switch.switch_with(
                lambda current: (placement, knobs or current.knobs) if current.placement.version == 0 else None)
            self._publish_metrics()
        except Exception:
            log.exception("initial placement failed; it is retried on the next registration")
            self._initial = None
            return
        if view is not None:
            if self.memory.restarted:
                log.info("placement rebuilt from the experts %d servers hold, as v%d", len(serving), view.placement.version)
            if self._recovery_timer is not None:
                self._recovery_timer.cancel()
                self._recovery_timer = None
            if any(s.server_id not in view.placement.servers() for s in self.registry.serving()):
                # servers that registered while it was being made (or held nothing) get experts now
                self._background(self.rebalance(force=True), "placing experts on servers outside the first placement", lambda: None)

    async def wait_placed(self, timeout_s: float) -> None:
        """Until some placement is committed (tests and `moemesh up` wait on this)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.board.version == 0:
            if loop.time() > deadline:
                raise TimeoutError(f"no placement committed within {timeout_s}s")
            await asyncio.sleep(0.02)

    def heartbeat(self, id_: str, adopted_version: int | None, stats: Any, instance: str = "") -> bool:
        """Records a heartbeat (the stats bounded: `load.bounded_stats`); False for an unknown id
        (or one registered by another instance: `Registry.heartbeat`)."""
        if stats is not None:
            stats = bounded_stats(stats, self.moe_layers, self.num_experts, self.cfg.max_expert_tokens_per_s)
        known = self.registry.heartbeat(id_, adopted_version, stats, instance)
        if known and adopted_version is not None and id_ in self.registry.attention:
            self.note_version(adopted_version)
        rec = self.registry.experts.get(id_) if known else None
        if rec is not None and rec.info.state == "serving" and stats is not None and stats.HasField("window_work"):
            self.history.record(id_, work_sample(stats.window_work), self.registry.clock())
        return known

    # ---- load and balance --------------------------------------------------------------------
    def load(self) -> torch.Tensor:
        """[L, E] tokens per (MoE layer, expert) over the live servers' load windows."""
        stats = [r.stats for r in self.registry.experts.values() if r.info.state != "dead"]
        return window_load(stats, self.moe_layers, self.num_experts)

    def budgets(self) -> list[ServerBudget]:
        return [
            ServerBudget.from_total(s.server_id, s.slot_budget, len(self.moe_layers), self.num_experts)
            for s in self.registry.serving()
        ]

    def _loaded(self, copies: int, seconds: float) -> None:
        """A server's prepare call loaded `copies` in `seconds`: the switch cost's rate (a running mean
        that follows the recent switches)."""
        if copies > 0:
            rate = seconds / copies
            self.seconds_per_copy = rate if self.seconds_per_copy is None else 0.5 * (self.seconds_per_copy + rate)

    def work(self) -> dict[str, WorkSample]:
        """Each serving server's work over its load window (from its last heartbeat)."""
        out = {}
        for rec in self.registry.experts.values():
            if rec.info.state == "serving" and rec.stats is not None and rec.stats.HasField("window_work"):
                out[rec.info.server_id] = work_sample(rec.stats.window_work)
        return out

    def cost_inputs(self, view: PlacementView) -> CostInputs:
        """The cost model as the servers' reports calibrate it, for the knobs of `view`."""
        top_k = view.knobs.effective(self.moe_layers[0], self.shape.top_k)[0]
        work = self.work()
        costs = calibrate(work, self.shape, len(self.moe_layers), history=self.history.earlier(work))
        if costs.cpu_servers:
            log.info("cost model: a call's CPU outside the kernel %s + %.1f us a row (%s)",
                     ", ".join(f"{sid} {1e3 * c.call_s:.2f} ms" for sid, c in sorted(costs.cpu_servers.items())), 1e6 * costs.call_row_s,
                     "fitted over the servers' windows" if costs.call_row_fitted else "the prior: the rows per call did not vary")
        return CostInputs(costs, self.shape, top_k, self.seconds_per_copy)

    def balancedness(self) -> float:
        placement = self.board.current.placement
        ids = [s.server_id for s in self.registry.serving()] or list(placement.servers())
        if placement.version == 0 or not ids:
            return 1.0
        return balancedness(self.load(), placement, ids, self.moe_layers)

    def _publish_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.set_placement(self.board.version, self.balancedness())

    # ---- placement changes -------------------------------------------------------------------
    async def rebalance(self, force: bool = False, prior: int = 1, dry_run: bool = False) -> RebalancePlan:
        """Solve for the window load (+ `prior` tokens per expert, so an idle mesh still spreads),
        price the candidates and switch when the plan says so (never for a dry run). Returns the
        plan (`placement` None: nothing planned). The solver runs off the event loop, on a thread of
        lower CPU priority; when the placement changed meanwhile it plans again under the switch lock. MeshError
        FAILED_PRECONDITION before the first placement or when the servers cannot hold the experts,
        ABORTED when the switch cannot be prepared."""
        view = self.board.current
        start = asyncio.get_running_loop().time()
        plan = await asyncio.get_running_loop().run_in_executor(self._planning, self._planner(view, force, prior))
        log.info("planned a rebalance in %.2fs: %s", asyncio.get_running_loop().time() - start,
                 "switch" if plan.placement is not None else plan.reason)
        if dry_run or plan.placement is None:
            return plan
        plans = [plan]

        def build(current: PlacementView):
            if current.placement.version != view.placement.version:
                plans.append(self._planner(current, force, prior)())
            p = plans[-1]
            return None if p.placement is None else (p.placement, current.knobs)

        committed = await self.switch.switch_with(build)
        self._publish_metrics()
        plan = plans[-1]
        if committed is not None:
            gain = f", predicted {plan.prediction.gain:.3f}x" if plan.prediction else ""
            log.info("rebalanced to v%d: balancedness %.3f -> %.3f, %d moves, %d tokens in the window%s",
                     committed.placement.version, plan.before, plan.after, plan.moves, plan.tokens, gain)
        return plan

    def _planner(self, view: PlacementView, force: bool, prior: int):
        """A call that plans from `view` with what the plane knows now (gathered here, on the loop)."""
        self._check_placed(view)
        budgets = self.budgets()
        if not budgets:
            raise MeshError(grpc.StatusCode.FAILED_PRECONDITION, "no serving expert server to place experts on")
        num_physical = None if self.cfg.redundant_experts is None else self._physical(budgets)
        load, cost = self.load(), self.cost_inputs(view)

        def plan() -> RebalancePlan:
            try:
                return plan_rebalance(load, budgets, view.placement, self.moe_layers, self.policy, num_physical, force, prior, cost)
            except ValueError as e:  # e.g. the serving servers' budgets cannot hold every expert
                raise MeshError(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from e

        return plan

    def _physical(self, budgets: list[ServerBudget]) -> int:
        """E + redundant_experts copies per layer, capped by what the budgets hold."""
        capacity = sum(min(b.slots, self.num_experts) for b in budgets)
        return max(self.num_experts, min(self.num_experts + self.cfg.redundant_experts, capacity))

    def predict_knobs(self, top_k: int | None, capacity_factor: float | None, layer: int | None) -> Prediction:
        """The step time now and with these knobs, as the cost model sees it: a top-k change scales
        each layer's rows by new / old top-k (the traffic to the experts); capacity does not enter."""
        view = self.board.current
        self._check_placed(view)
        new = view.knobs.updated(top_k, capacity_factor, layer)
        ratio = torch.tensor([[new.effective(l, self.shape.top_k)[0] / view.knobs.effective(l, self.shape.top_k)[0]]
                              for l in self.moe_layers], dtype=torch.float64)  # [L, 1]
        cost = self.cost_inputs(view)
        rows = rows_per_step(self.load() + 1, cost.costs, cost.top_k)
        return predict(rows, view.placement, rows * ratio, view.placement, self.moe_layers, cost.costs)

    async def set_knobs(self, top_k: int | None, capacity_factor: float | None, layer: int | None) -> PlacementView:
        """Commit a new version with the same replicas and the changed knobs; returns once every
        live attention replica runs it (or after `release_timeout_s`). MeshError INVALID_ARGUMENT
        for bad values, FAILED_PRECONDITION before the first placement, ABORTED as `rebalance`."""
        self.check_knobs(top_k, capacity_factor, layer)

        def build(view: PlacementView):
            self._check_placed(view)
            self.memory.knobs_set = True
            return view.placement, view.knobs.updated(top_k, capacity_factor, layer)

        view = await self.switch.switch_with(build)
        await self.switch.wait_adopted(view.placement.version, self.cfg.release_timeout_s)
        self._publish_metrics()
        return view

    def check_knobs(self, top_k: int | None, capacity_factor: float | None, layer: int | None) -> None:
        """MeshError INVALID_ARGUMENT naming the field when these knob values do not fit the model."""
        try:
            check_change(self.moe_layers, self.num_experts, top_k, capacity_factor, layer)
        except ValueError as e:
            raise invalid(str(e)) from e

    def check_knob_set(self, knobs: MoeKnobs) -> None:
        """MeshError INVALID_ARGUMENT naming the field unless every value of `knobs` fits the model."""
        for top_k, cf, layer in [(knobs.top_k, knobs.capacity_factor, None)] + [(s.top_k, s.capacity_factor, s.layer) for s in knobs.layers]:
            if top_k is not None or cf is not None:
                self.check_knobs(top_k, cf, layer)

    @staticmethod
    def _check_placed(view: PlacementView) -> None:
        if view.placement.version == 0:
            raise MeshError(grpc.StatusCode.FAILED_PRECONDITION, "no placement yet: the expert servers have not all registered")

    def drain(self, server_id: str) -> tuple[str, bool]:
        """Mark `server_id` draining and, when other servers serve, switch in a placement without
        it in the background (its experts are dropped from it at release). Returns (state, moving)."""
        state = self.registry.drain(server_id)
        placement = self.board.current.placement
        if server_id not in placement.servers():
            return state, False
        if not self._targets():
            log.warning("draining server %s: no other serving server can take its experts", server_id)
            return state, False
        self.moving.add(server_id)
        self._background(self._evacuate(server_id), f"evacuating {server_id}", lambda: self.moving.discard(server_id))
        return state, True

    def undrain(self, server_id: str) -> tuple[str, bool]:
        """A draining server serves again; once a placement exists, a forced rebalance (queued behind
        an evacuation still running) gives it experts back. Returns (state, placing)."""
        state = self.registry.undrain(server_id)
        self.moving.discard(server_id)
        if self.board.version == 0:
            return state, False
        self._background(self.rebalance(force=True), f"placing experts on undrained server {server_id}", lambda: None)
        return state, True

    def _targets(self) -> list[tuple[str, int]]:
        return [(s.server_id, s.slot_budget) for s in self.registry.serving()]

    async def _evacuate(self, server_id: str) -> None:
        """Switch to a placement without `server_id`: its copies with replicas are dropped, sole
        copies move (evacuate); when the others lack free slots for that, the solver re-places
        everything within their budgets (ValueError when even that cannot hold every expert)."""

        def build(view: PlacementView):
            if server_id not in view.placement.servers():
                return None
            try:
                return evacuate(view.placement, server_id, self._targets(), version=view.placement.version + 1), view.knobs
            except ValueError as e:
                log.info("moving the experts of %s needs a re-solve: %s", server_id, e)
            budgets = self.budgets()
            num_physical = None if self.cfg.redundant_experts is None else self._physical(budgets)
            plan = plan_rebalance(self.load(), budgets, view.placement, self.moe_layers, self.policy, num_physical, force=True, prior=1,
                                  cost=self.cost_inputs(view))
            return None if plan.placement is None else (plan.placement, view.knobs)

        await self.switch.switch_with(build)
        self._publish_metrics()

    # ---- failures ----------------------------------------------------------------------------
    def declare_dead(self, server_id: str, why: str) -> bool:
        """Mark `server_id` dead and move its experts away in the background; False if it already was."""
        if not self.registry.mark_dead(server_id):
            return False
        self._fail_over(server_id, why)
        return True

    def _fail_over(self, server_id: str, why: str) -> None:
        log.warning("expert server %s is dead (%s): moving its experts away", server_id, why)

        async def evacuate_and_forget() -> None:
            try:
                await self.board.note_dead(tuple(self.registry.dead()))  # replicas fail its waiting calls over now
                await self._evacuate(server_id)
            finally:
                await self.ops.forget(server_id)  # its channel (and reconnect backoff) goes with it

        self._background(evacuate_and_forget(), f"failover of {server_id}", lambda: None)

    async def report_failure(self, server_id: str, detail: str) -> bool:
        """An attention replica could not reach `server_id`. Probe it; when it does not answer
        within `failure_probe_timeout_s` declare it dead. Returns whether it is dead now."""
        rec = self.registry.experts.get(server_id)
        if rec is None:
            return False
        if rec.info.state == "dead":
            return True
        try:
            await asyncio.wait_for(self.ops.ping(rec.info, self.cfg.failure_probe_timeout_s), self.cfg.failure_probe_timeout_s)
            log.info("expert server %s was reported unreachable (%s) but answers", server_id, detail)
            return False
        except Exception as e:  # noqa: BLE001 - any failure to answer is the evidence we probe for
            self.declare_dead(server_id, f"reported unreachable ({detail}); probe failed: {type(e).__name__}")
            return True

    def _background(self, coro, what: str, then: Callable[[], None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)

        def finished(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            then()
            if not t.cancelled() and t.exception() is not None:
                log.error("%s failed: %s", what, t.exception())

        task.add_done_callback(finished)

    # ---- after a restart: versions and knobs from before it (RestartMemory decides) --------------
    def note_version(self, version: int, at_least: bool = False) -> None:
        """A server or replica has seen placement `version` (`RestartMemory.note_version`)."""
        if self.memory.note_version(version, self.board.version, at_least):
            self._background(self._renumber(), f"renumbering the placement above v{version}", lambda: None)

    async def _renumber(self) -> None:
        def build(view: PlacementView):
            if view.placement.version == 0 or view.placement.version > self.memory.floor:
                return None
            return view.placement, view.knobs

        view = await self.switch.switch_with(build)
        if view is not None:
            log.info("placement committed again as v%d, above the versions replicas reported", view.placement.version)
            self._publish_metrics()

    def _inherit_knobs(self, version: int, knobs: MoeKnobs) -> None:
        """A restarted plane on which no knobs were set takes over the knobs replicas ran before the
        restart (a restart must not change what requests run with)."""
        if self.memory.inherit(version, knobs, self.board.version, self.board.current.knobs):
            self._background(self._take_inherited_knobs(), "taking over the knobs replicas ran before the restart", lambda: None)

    async def _take_inherited_knobs(self) -> None:
        def build(view: PlacementView):
            knobs = self.memory.inherited_knobs()
            if view.placement.version == 0 or knobs is None or knobs == view.knobs:
                return None
            return view.placement, knobs

        view = await self.switch.switch_with(build)
        if view is not None:
            log.info("placement v%d carries the knobs replicas ran before the restart (%s)", view.placement.version, view.knobs.describe())
            self._publish_metrics()

    async def _recover_after(self, wait_s: float) -> None:
        await asyncio.sleep(wait_s)
        self._recovery_timer = None
        if self.board.version == 0 and self.registry.serving():
            log.warning("rebuilding the placement after %.1fs with %d of %d expected expert servers back",
                        wait_s, len(self.registry.serving()), self.expected)
            self._start_initial()

    def close(self) -> None:
        """Stop the solver's thread (a plan in progress finishes first)."""
        self._planning.shutdown(wait=False, cancel_futures=True)

    # ---- loops -------------------------------------------------------------------------------
    async def reap_forever(self) -> None:
        """Declare silent servers dead (failover) within a tenth of `dead_after_s` (at most a heartbeat
        interval) of their deadline; refresh the metrics every heartbeat interval."""
        loop = asyncio.get_running_loop()
        tick = min(self.heartbeat_interval_s, self.dead_after_s / 10)
        metrics_due = loop.time()
        while True:
            await asyncio.sleep(tick)
            for server_id in self.registry.reap(self.dead_after_s):
                self._fail_over(server_id, f"no heartbeat for {self.dead_after_s}s")
            if loop.time() >= metrics_due:
                metrics_due = loop.time() + self.heartbeat_interval_s
                self._publish_metrics()  # the load window moves on: keep the balancedness gauge current

    async def rebalance_forever(self) -> None:
        """Every `rebalance_interval_s`: refresh the balance metrics and rebalance when worth it."""
        while True:
            await asyncio.sleep(self.cfg.rebalance_interval_s)
            if self.board.version == 0 or self.switch.running:
                continue
            try:
                plan = await self.rebalance()
                if plan.placement is None:
                    log.debug("no rebalance: %s", plan.reason)
            except Exception as e:  # noqa: BLE001 - the next period tries again
                log.warning("periodic rebalance failed: %s", e)

