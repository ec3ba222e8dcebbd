"""`ControlPlane` without gRPC: fake expert-server ops, a fake clock, load reports as ExpertStats."""
import asyncio

import grpc
import pytest

from control_svc.config import ControlConfig
from control_svc.plane import ControlPlane
from control_svc.registry import Registry
from moemesh.contracts.info import ServerInfo
from moemesh.errors import MeshError
from moemesh.rpc.protos import load as load_protos
from moemesh.telemetry import ServiceMetrics
from tests.fixtures.auth import TEST_RPC

expert_pb2, _ = load_protos("expert")
LAYERS = (0, 1)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class FakeOps:
    def __init__(self):
        self.held: dict[str, set[tuple[int, int]]] = {}
        self.down: set[str] = set()

    async def load(self, server, experts, version):
        if server.server_id in self.down:
            raise ConnectionError(f"{server.server_id} is down")
        self.held.setdefault(server.server_id, set()).update((l, e) for l, es in experts.items() for e in es)

    async def drop(self, server, experts, version):
        self.held[server.server_id] -= {(l, e) for l, es in experts.items() for e in es}

    async def ping(self, server, timeout_s):
        if server.server_id in self.down:
            raise ConnectionError("refused")

    async def forget(self, server_id):
        self.held.pop(server_id, None)


def stats(tokens: dict[tuple[int, int], int]):
    return expert_pb2.ExpertStats(loads=[expert_pb2.ExpertLoad(layer=l, expert_id=e, tokens=n) for (l, e), n in tokens.items()])


def make_plane(**cfg):
    clock = Clock()
    ops = FakeOps()
    metrics = ServiceMetrics("control")
    config = ControlConfig(**{"model_dir": "unused", "rpc": TEST_RPC, "expected_expert_servers": 2, "heartbeat_interval_s": 0.01,
                              "dead_after_s": 1.0, "release_timeout_s": 0.05, "rebalance_min_tokens": 100, **cfg})
    return ControlPlane(LAYERS, 8, config, ops, Registry(clock=clock), metrics), ops, clock, metrics


async def settle(plane):
    for _ in range(200):
        if not plane._tasks and (plane._initial is None or plane._initial.done()) and not plane.switch.running:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("placement changes did not settle")


async def two_servers(plane):
    for port in (1, 2):
        plane.register_expert(ServerInfo("", f"127.0.0.1:{port}"))
    await plane.wait_placed(5)
    await settle(plane)


def skew(plane):
    """Hot experts 0 and 2 (both on expert-0 after round robin) reported by their server."""
    plane.heartbeat("expert-0", None, stats({(l, e): (3000 if e in (0, 2) else 10) for l in LAYERS for e in range(0, 8, 2)}))
    plane.heartbeat("expert-1", None, stats({(l, e): 10 for l in LAYERS for e in range(1, 8, 2)}))


def test_rebalance_spreads_hot_experts_and_publishes_balancedness():
    async def main():
        plane, ops, _, metrics = make_plane(redundant_experts=2)
        await two_servers(plane)
        skew(plane)
        before = plane.balancedness()
        plan = await plane.rebalance()
        assert plan.placement is not None and plane.board.version == 2
        assert before < 0.6 and plane.balancedness() > 0.9
        for layer in LAYERS:  # the two hot experts no longer share one server alone (moved, or replicated)
            owners = [set(plane.board.current.placement.replicas[layer][e]) for e in (0, 2)]
            assert owners[0] != owners[1] or owners[0] == {"expert-0", "expert-1"}
            assert ops.held["expert-1"] & {(layer, 0), (layer, 2)}  # prepared before the commit
        text = metrics.render().decode()
        assert 'moemesh_placement_version{service="control"} 2.0' in text
        assert "moemesh_placement_balancedness" in text
        again = await plane.rebalance()  # the same load: nothing better to switch to
        assert again.placement is None and plane.board.version == 2

    asyncio.run(main())


def work_stats(tokens: dict[tuple[int, int], int], requests: int, expert_calls: int, busy_s: float, service_s: float):
    """A heartbeat's stats with its window work (10 s of it)."""
    st = stats(tokens)
    st.window_work.CopyFrom(expert_pb2.ExpertWork(seconds=10.0, requests=requests, expert_calls=expert_calls,
                                                  rows=sum(tokens.values()), busy_seconds=busy_s, service_seconds=service_s))
    return st


def test_the_calls_measured_cpu_reaches_the_cost_model():
    async def main():
        plane, *_ = make_plane()
        await two_servers(plane)
        for sid in ("expert-0", "expert-1"):
            st = work_stats({(l, e): 50 for l in LAYERS for e in range(8)}, requests=400, expert_calls=800, busy_s=1.0, service_s=2.0)
            st.window_work.cpu_seconds, st.window_work.cpu_limit = 1.0, 0.1
            st.window_work.compute_cpu_seconds, st.window_work.call_cpu_seconds = 0.25, 0.5
            st.window_work.change_cpu_seconds = 0.125
            plane.heartbeat(sid, None, st)
        w = plane.work()["expert-0"]
        assert (w.cpu_s, w.cpu_limit, w.compute_cpu_s, w.call_cpu_s, w.change_cpu_s) == (1.0, 0.1, 0.25, 0.5, 0.125)
        costs = plane.cost_inputs(plane.board.current).costs
        # the call's CPU: all the process's CPU outside the kernel and the placement changes (0.625 s) over its 400 calls
        assert costs.cpu("expert-0").call_s == pytest.approx(0.625 / 400)

    asyncio.run(main())


def test_a_dry_run_prices_the_plan_from_the_servers_reports_and_switches_nothing():
    async def main():
        plane, ops, _, _ = make_plane(redundant_experts=2)
        await two_servers(plane)
        hot = {(l, e): (3000 if e in (0, 2) else 10) for l in LAYERS for e in range(0, 8, 2)}
        cold = {(l, e): 10 for l in LAYERS for e in range(1, 8, 2)}
        plane.heartbeat("expert-0", None, work_stats(hot, requests=400, expert_calls=1600, busy_s=6.0, service_s=7.0))
        plane.heartbeat("expert-1", None, work_stats(cold, requests=400, expert_calls=300, busy_s=0.5, service_s=1.5))
        held = {s: set(h) for s, h in ops.held.items()}
        plan = await plane.rebalance(dry_run=True)
        assert plan.placement is not None and plane.board.version == 1 and ops.held == held  # nothing loaded
        assert plan.prediction.gain > 1.05 and plan.switch.copies == plan.moves > 0
        cost = plane.cost_inputs(plane.board.current).costs
        assert cost.calibrated and cost.steps == 400 / len(LAYERS) and cost.step_s == 10.0 / 200
        assert cost.server("expert-0").call_s == pytest.approx(1.0 / 400)
        switched = await plane.rebalance()
        assert switched.placement == plane.board.current.placement and plane.board.version == 2
        assert plane.seconds_per_copy is not None  # the prepare phase's rate, for the next switch's cost

    asyncio.run(main())


def test_a_lower_top_k_is_predicted_faster():
    async def main():
        plane, _, _, _ = make_plane()
        await two_servers(plane)
        skew(plane)
        halved = plane.predict_knobs(1, None, None)  # the model's top-2 of 8 -> 1
        assert halved.gain > 1.0
        assert plane.predict_knobs(None, 1.5, None).gain == pytest.approx(1.0)  # capacity is not in the model
        assert plane.board.version == 1

    asyncio.run(main())


def test_knobs_are_a_new_version_with_the_same_replicas():
    async def main():
        plane, _, _, _ = make_plane()
        await two_servers(plane)
        replicas = plane.board.current.placement.replicas
        view = await plane.set_knobs(1, None, None)
        assert view.placement.version == 2 and view.placement.replicas == replicas
        assert view.knobs.top_k == 1 and plane.board.current.knobs.top_k == 1
        view = await plane.set_knobs(None, 1.5, 1)
        assert view.knobs.effective(1, 2) == (1, 1.5) and view.knobs.effective(0, 2) == (1, 0.0)
        with pytest.raises(MeshError, match="top_k") as e:
            await plane.set_knobs(0, None, None)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert plane.board.version == 3

    asyncio.run(main())


def test_a_server_joining_later_gets_experts():
    async def main():
        plane, ops, _, _ = make_plane()
        await two_servers(plane)
        plane.register_expert(ServerInfo("", "127.0.0.1:3"))
        await settle(plane)
        assert "expert-2" in plane.board.current.placement.servers() and ops.held["expert-2"]

    asyncio.run(main())


def test_silent_server_is_declared_dead_and_its_experts_move():
    async def main():
        plane, ops, clock, _ = make_plane()
        await two_servers(plane)
        reaper = asyncio.create_task(plane.reap_forever())
        try:
            clock.t = 0.5
            plane.heartbeat("expert-0", None, None)
            clock.t = 1.2  # expert-1 silent for 1.2 s > dead_after_s
            for _ in range(100):
                if plane.board.version == 2:
                    break
                await asyncio.sleep(0.01)
        finally:
            reaper.cancel()
        await settle(plane)
        assert plane.registry.experts["expert-1"].info.state == "dead"
        assert plane.board.current.placement.servers() == ("expert-0",)
        assert len(ops.held["expert-0"]) == 16

    asyncio.run(main())


def test_the_placement_without_a_dead_server_names_it_dead_to_the_replicas():
    """The update that drops a server lists it (PlacementUpdate.dead_servers): replicas fail the calls
    still waiting on it at once instead of waiting for their timeout."""
    from control_svc.servicer import update_message

    async def main():
        plane, _, _, _ = make_plane()
        await two_servers(plane)
        assert plane.board.current.dead == () and list(update_message(plane.board.current).dead_servers) == []
        assert plane.declare_dead("expert-1", "test")
        await settle(plane)
        view = plane.board.current
        assert view.placement.servers() == ("expert-0",)
        assert view.dead == ("expert-1",) and list(update_message(view).dead_servers) == ["expert-1"]

    asyncio.run(main())


def test_replicas_hear_of_a_death_at_once_even_when_no_placement_without_the_server_comes():
    """A death notice goes to the watchers before the failover's placement: here the survivor cannot
    load the dead server's sole copies, so that placement never comes, yet the replicas are told (the
    committed version again, listing the server) and fail its waiting calls now. A watcher that
    subscribes afterwards at that version hears it first of all."""
    async def main():
        plane, ops, _, _ = make_plane()
        await two_servers(plane)  # round robin: every copy sole
        version = plane.board.version
        heard = []

        async def watch(after):
            async for view in plane.board.watch(after):
                heard.append((after, view.placement.version, view.dead))

        early = asyncio.create_task(watch(version))
        await asyncio.sleep(0.01)
        ops.down.add("expert-0")  # loads on the survivor fail: no placement without expert-1
        assert plane.declare_dead("expert-1", "test")
        await settle(plane)
        assert plane.board.version == version and "expert-1" in plane.board.current.placement.servers()
        late = asyncio.create_task(watch(version))
        for _ in range(100):
            if len(heard) >= 2:
                break
            await asyncio.sleep(0.01)
        early.cancel()
        late.cancel()
        assert sorted(heard) == [(version, version, ("expert-1",))] * 2

    asyncio.run(main())


def test_a_silent_server_is_declared_dead_within_a_tenth_of_dead_after_not_a_heartbeat_interval():
    """The reaper looks every dead_after_s / 10 when that is shorter than the heartbeat interval, so a
    hung server's calls fail over about dead_after_s after its last heartbeat."""
    async def main():
        plane, _, clock, _ = make_plane(heartbeat_interval_s=4.0, dead_after_s=5.0)
        await two_servers(plane)
        clock.t = 5.5  # expert-1 silent past dead_after_s: the next look declares it dead
        plane.heartbeat("expert-0", None, None)
        reaper = asyncio.create_task(plane.reap_forever())
        try:
            for _ in range(300):  # up to 3 s, under the 4 s heartbeat interval
                if plane.registry.experts["expert-1"].info.state == "dead":
                    break
                await asyncio.sleep(0.01)
            assert plane.registry.experts["expert-1"].info.state == "dead"
        finally:
            reaper.cancel()
        await settle(plane)

    asyncio.run(main())


def test_reported_failure_is_probed_before_declaring_death():
    async def main():
        plane, ops, _, _ = make_plane()
        await two_servers(plane)
        assert await plane.report_failure("expert-1", "UNAVAILABLE") is False  # it answers the probe
        assert plane.board.version == 1
        ops.down.add("expert-1")
        assert await plane.report_failure("expert-1", "UNAVAILABLE") is True
        assert await plane.report_failure("expert-1", "again") is True  # a second reporter
        assert await plane.report_failure("expert-9", "unknown") is False
        await settle(plane)
        assert plane.board.current.placement.servers() == ("expert-0",)

    asyncio.run(main())


def test_failover_re_solves_when_the_survivors_lack_free_slots_and_keeps_the_placement_when_nothing_fits():
    async def main():
        plane, _, _, _ = make_plane(redundant_experts=8)
        for port, budget in ((1, 16), (2, 16)):
            plane.register_expert(ServerInfo("", f"127.0.0.1:{port}", slot_budget=budget))
        await plane.wait_placed(5)
        await settle(plane)
        await plane.rebalance(force=True)  # 16 copies per layer: both servers full
        await settle(plane)
        assert plane.board.current.placement.servers() == ("expert-0", "expert-1")
        plane.register_expert(ServerInfo("", "127.0.0.1:3", slot_budget=8))
        await settle(plane)
        version = plane.board.version
        plane.declare_dead("expert-0", "test")
        await settle(plane)
        after = plane.board.current.placement
        assert after.version == version + 1 and "expert-0" not in after.servers()
        plane.declare_dead("expert-1", "test")  # expert-2's 8 slots cannot hold 16 experts
        await settle(plane)
        assert plane.board.current.placement == after

    asyncio.run(main())


def test_periodic_rebalance_switches_once_the_load_is_skewed():
    async def main():
        plane, _, _, _ = make_plane(redundant_experts=2, rebalance_interval_s=0.02)
        await two_servers(plane)
        loop = asyncio.create_task(plane.rebalance_forever())
        try:
            await asyncio.sleep(0.1)
            assert plane.board.version == 1  # no load yet: fewer than rebalance_min_tokens
            skew(plane)
            for _ in range(200):
                if plane.board.version == 2:
                    break
                await asyncio.sleep(0.01)
        finally:
            loop.cancel()
        assert plane.board.version == 2 and plane.balancedness() > 0.9

    asyncio.run(main())
