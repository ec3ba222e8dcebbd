"""A restarted control plane: the placement rebuilt from what the expert servers hold (the pure
function, then the plane with fake ops), ids kept across the restart, versions numbered above what
anyone reported."""
import asyncio

import pytest

from control_svc.recovery import RestartMemory, check_held, rebuild_placement
from control_svc.registry import Registry
from moemesh.contracts.info import ServerInfo
from moemesh.contracts.knobs import MoeKnobs
from moemesh.errors import MeshError
from tests.control_svc.test_plane import Clock, make_plane, settle, two_servers

LAYERS = (0, 1)


# ---- rebuild_placement: reports -> placement ---------------------------------------------------
def test_every_held_copy_stays_where_it_is():
    held = {
        "expert-0": {0: (0, 1, 2, 3), 1: (0, 1, 2, 3, 4)},
        "expert-1": {0: (3, 4, 5, 6, 7), 1: (4, 5, 6, 7)},
    }
    p = rebuild_placement(LAYERS, 8, held, {"expert-0": 0, "expert-1": 0}, version=7)
    assert p.version == 7
    assert p.replicas[0] == (("expert-0",),) * 3 + (("expert-0", "expert-1"),) + (("expert-1",),) * 4
    assert p.replicas[1][4] == ("expert-0", "expert-1")
    assert p.experts_on("expert-0") == {0: (0, 1, 2, 3), 1: (0, 1, 2, 3, 4)}


def test_copies_nobody_holds_go_to_the_emptiest_server_with_a_free_slot():
    # expert-2 did not come back: layer 0 experts 6, 7 and layer 1 expert 7 have no holder
    held = {"expert-0": {0: (0, 1, 2), 1: (0, 1, 2, 3)}, "expert-1": {0: (3, 4, 5), 1: (4, 5, 6)}}
    p = rebuild_placement(LAYERS, 8, held, {"expert-0": 8, "expert-1": 8}, version=3)
    # layer 0: both hold 3 there -> expert 6 to expert-1 (fewer copies in all: 6 < 7), then expert 7 to
    # expert-0 (fewer in the layer)
    assert p.replicas[0][6] == ("expert-1",) and p.replicas[0][7] == ("expert-0",)
    assert p.replicas[1][7] == ("expert-1",)  # layer 1: expert-1 holds 3, expert-0 holds 4
    for layer in LAYERS:
        assert all(p.replicas[layer][e] for e in range(8))


def test_slot_budgets_are_respected_and_no_room_is_an_error():
    held = {"expert-0": {0: (0, 1, 2, 3), 1: (0, 1, 2, 3)}, "expert-1": {0: (4, 5, 6), 1: (4, 5, 6)}}
    p = rebuild_placement(LAYERS, 8, held, {"expert-0": 8, "expert-1": 8}, version=2)
    assert p.replicas[0][7] == ("expert-1",) and p.replicas[1][7] == ("expert-1",)  # expert-0 is full
    with pytest.raises(ValueError, match="slot_budget: no server has a free slot for layer 1 expert 7"):
        rebuild_placement(LAYERS, 8, held, {"expert-0": 8, "expert-1": 7}, version=2)


def test_reports_of_servers_that_are_not_serving_are_ignored():
    held = {"expert-0": {0: tuple(range(8)), 1: tuple(range(8))}, "expert-9": {0: (0,), 1: (0,)}}
    p = rebuild_placement(LAYERS, 8, held, {"expert-0": 0}, version=1)
    assert p.servers() == ("expert-0",)
    with pytest.raises(ValueError, match="servers"):
        rebuild_placement(LAYERS, 8, held, {}, version=1)


def test_held_reports_are_checked_against_the_model():
    check_held({0: (0, 7), 1: ()}, LAYERS, 8)
    with pytest.raises(ValueError, match="held: layer 2 is not a MoE layer"):
        check_held({2: (0,)}, LAYERS, 8)
    with pytest.raises(ValueError, match=r"held: layer 1 experts \[8\] are out of range"):
        check_held({1: (1, 8)}, LAYERS, 8)


# ---- the registry across a restart --------------------------------------------------------------
# ---- RestartMemory: reported versions and knobs -> decisions -------------------------------------
def test_a_version_reported_before_any_placement_marks_a_restart_and_raises_the_floor():
    m = RestartMemory()
    assert not m.note_version(0, committed=0) and not m.restarted  # "seen none" says nothing
    assert not m.note_version(5, committed=0) and m.restarted and m.floor == 5
    assert not m.note_version(3, committed=0) and m.floor == 5


def test_a_version_above_the_committed_one_asks_for_a_renumbering():
    fresh = RestartMemory()
    assert not fresh.note_version(4, committed=4, at_least=True)  # a fresh plane's own number
    assert fresh.note_version(5, committed=4) and fresh.floor == 5
    restarted = RestartMemory()
    restarted.note_version(4, committed=0)
    assert restarted.note_version(4, committed=4, at_least=True)  # may be the old plane's v4
    assert not restarted.note_version(4, committed=4)  # a server adopting ours


def test_inherited_knobs_are_the_newest_reported_and_lose_to_knobs_set_here():
    k4, k8 = MoeKnobs(top_k=4), MoeKnobs(top_k=8)
    fresh = RestartMemory()
    assert not fresh.inherit(3, k4, committed=1, current=k8) and fresh.inherited_knobs() is None
    m = RestartMemory()
    m.note_version(3, committed=0)
    assert not m.inherit(3, k4, committed=0, current=k8)  # no placement yet: it goes into the rebuild
    assert not m.inherit(2, k8, committed=0, current=k8)  # older than what is kept
    assert m.inherited_knobs() == k4
    assert m.inherit(3, k4, committed=5, current=k8)  # a placement with other knobs: commit
    assert not m.inherit(3, k4, committed=5, current=k4)  # already running them
    m.knobs_set = True
    assert m.inherited_knobs() is None and not m.inherit(9, k8, committed=5, current=k4)


def test_a_claimed_id_is_kept_only_when_never_given_out_here():
    reg = Registry(clock=Clock())
    assert reg.register_expert(ServerInfo("expert-1", "127.0.0.1:2")).server_id == "expert-1"  # a restarted registry
    # fresh ids go above every claimed one (a server that has not come back yet may claim a lower one)
    assert reg.register_expert(ServerInfo("", "127.0.0.1:3")).server_id == "expert-2"
    assert reg.register_expert(ServerInfo("expert-0", "127.0.0.1:4")).server_id == "expert-0"
    assert reg.register_expert(ServerInfo("expert-1", "127.0.0.1:5")).server_id == "expert-3"  # given out already
    assert reg.register_expert(ServerInfo("not-ours", "127.0.0.1:6")).server_id == "expert-4"


def test_a_heartbeat_from_another_instance_of_an_id_is_not_known():
    reg = Registry(clock=Clock())
    sid = reg.register_expert(ServerInfo("", "127.0.0.1:2"), instance="a").server_id
    rid = reg.register_attention("127.0.0.1:9", instance="b")
    assert reg.heartbeat(sid, instance="a") and reg.heartbeat(rid, 1, instance="b")
    assert not reg.heartbeat(sid, instance="x") and not reg.heartbeat(rid, 1, instance="x")
    assert reg.heartbeat(sid)  # unchecked without a token


# ---- the plane: rebuild, numbering, late arrivals ------------------------------------------------
async def placed_then_restarted(**cfg):
    """Plane A places experts on two servers and commits v2 (a knob change); plane B starts empty."""
    old, ops, _, _ = make_plane(**cfg)
    await two_servers(old)
    await old.set_knobs(1, None, None)
    assert old.board.version == 2
    new, new_ops, _, _ = make_plane(**cfg)
    new_ops.held = {sid: set(copies) for sid, copies in ops.held.items()}
    return old, new, new_ops


def held_of(ops, sid):
    out = {}
    for layer, e in sorted(ops.held.get(sid, ())):
        out.setdefault(layer, []).append(e)
    return {layer: tuple(es) for layer, es in out.items()}


def test_a_restarted_plane_rebuilds_the_placement_from_what_the_servers_hold():
    async def main():
        old, new, ops = await placed_then_restarted()
        before = old.board.current.placement
        for port, sid in ((1, "expert-0"), (2, "expert-1")):
            info = new.register_expert(ServerInfo(sid, f"127.0.0.1:{port}"), held_of(ops, sid), reported_version=2)
            assert info.server_id == sid  # the id it had
        await new.wait_placed(5)
        await settle(new)
        after = new.board.current.placement
        assert after.version == 3 and after.replicas == before.replicas  # above v2: replicas adopt it
        assert {sid: held_of(ops, sid) for sid in ops.held} == {sid: before.experts_on(sid) for sid in before.servers()}

    asyncio.run(main())


def test_a_replica_that_ran_a_newer_version_gets_the_placement_numbered_above_it():
    async def main():
        old, new, ops = await placed_then_restarted()
        new.register_attention("127.0.0.1:9", seen_version=5)  # before the rebuild: raises the floor
        for port, sid in ((1, "expert-0"), (2, "expert-1")):
            new.register_expert(ServerInfo(sid, f"127.0.0.1:{port}"), held_of(ops, sid), reported_version=2)
        await new.wait_placed(5)
        await settle(new)
        assert new.board.version == 6
        new.register_attention("127.0.0.1:10", seen_version=6)  # after it: the same number may be another placement
        await settle(new)
        assert new.board.version == 7 and new.board.current.placement.replicas == old.board.current.placement.replicas
        rid = new.register_attention("127.0.0.1:11", seen_version=3)  # older: nothing to do
        await settle(new)
        assert new.board.version == 7
        new.heartbeat(rid, 9, None)  # a heartbeat from beyond the committed version
        await settle(new)
        assert new.board.version == 10

    asyncio.run(main())


def test_without_every_expected_server_the_rebuild_waits_then_re_places_what_is_missing():
    async def main():
        old, new, ops = await placed_then_restarted(recovery_wait_s=0.2)
        new.register_expert(ServerInfo("expert-0", "127.0.0.1:1"), held_of(ops, "expert-0"), reported_version=2)
        await asyncio.sleep(0.1)
        assert new.board.version == 0  # still waiting for expert-1
        await new.wait_placed(5)
        await settle(new)
        p = new.board.current.placement
        assert p.version == 3 and p.servers() == ("expert-0",)
        assert all(p.replicas[layer][e] == ("expert-0",) for layer in LAYERS for e in range(8))
        assert len(ops.held["expert-0"]) == 16  # the missing copies were loaded before the commit

        # the other server comes back late: what it holds is not placed, so it joins like a new server
        new.register_expert(ServerInfo("expert-1", "127.0.0.1:2"), held_of(ops, "expert-1"), reported_version=2)
        await settle(new)
        assert "expert-1" in new.board.current.placement.servers()

    asyncio.run(main())


def test_a_fresh_mesh_still_waits_for_the_expected_servers():
    async def main():
        plane, _, _, _ = make_plane(recovery_wait_s=0.05)
        plane.register_expert(ServerInfo("", "127.0.0.1:1"))
        await asyncio.sleep(0.2)
        assert plane.board.version == 0 and not plane.memory.restarted
        plane.register_expert(ServerInfo("", "127.0.0.1:2"))
        await plane.wait_placed(5)
        await settle(plane)
        assert plane.board.version == 1
        plane.register_attention("127.0.0.1:9", seen_version=1)  # a replica that got v1 from this plane
        await settle(plane)
        assert plane.board.version == 1  # nothing to renumber: every version here is this plane's

    asyncio.run(main())


def test_bad_held_reports_are_refused():
    async def main():
        plane, _, _, _ = make_plane()
        with pytest.raises(MeshError, match="held: layer 5"):
            plane.register_expert(ServerInfo("", "127.0.0.1:1"), {5: (0,)}, reported_version=1)
        assert plane.registry.experts == {}

    asyncio.run(main())


def test_the_knobs_replicas_ran_survive_the_restart():
    async def main():
        old, new, ops = await placed_then_restarted()
        knobs = old.board.current.knobs
        assert knobs.top_k == 1
        for port, sid in ((1, "expert-0"), (2, "expert-1")):
            new.register_expert(ServerInfo(sid, f"127.0.0.1:{port}"), held_of(ops, sid), reported_version=2)
        await new.wait_placed(5)
        await settle(new)
        assert new.board.current.knobs.top_k is None  # no replica has told it yet
        new.register_attention("127.0.0.1:9", seen_version=2, knobs=knobs)  # registers after the rebuild
        await settle(new)
        assert new.board.current.knobs == knobs and new.board.current.placement.replicas == old.board.current.placement.replicas

        # knobs set on the new plane win over what a lagging replica ran
        await new.set_knobs(2, None, None)
        new.register_attention("127.0.0.1:10", seen_version=2, knobs=knobs)
        await settle(new)
        assert new.board.current.knobs.top_k == 2

    asyncio.run(main())


def test_knobs_a_replica_reports_before_the_rebuild_go_into_it():
    async def main():
        old, new, ops = await placed_then_restarted()
        new.register_attention("127.0.0.1:9", seen_version=2, knobs=old.board.current.knobs)
        for port, sid in ((1, "expert-0"), (2, "expert-1")):
            new.register_expert(ServerInfo(sid, f"127.0.0.1:{port}"), held_of(ops, sid), reported_version=2)
        await new.wait_placed(5)
        await settle(new)
        assert new.board.version == 3 and new.board.current.knobs.top_k == 1
        with pytest.raises(MeshError, match="top_k must be in"):
            new.register_attention("127.0.0.1:10", seen_version=2, knobs=MoeKnobs(top_k=9))

    asyncio.run(main())
