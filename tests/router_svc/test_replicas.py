import asyncio

import pytest

import grpc

from moemesh.contracts.info import LoadReport
from moemesh.errors import MeshError
from router_svc.replicas import Replica, ReplicaSet


class FakeLoad:
    def __init__(self, report=None, fail=False):
        self.report, self.fail = report or LoadReport(), fail

    async def get_load(self, timeout):
        if self.fail:
            raise ConnectionError("down")
        return self.report


def test_picks_the_least_loaded_counting_own_inflight():
    a, b = Replica("a", FakeLoad()), Replica("b", FakeLoad())
    rs = ReplicaSet([a, b])
    picked = []
    for _ in range(4):
        r = rs.pick()
        picked.append(r.address)
        r.inflight += 1
    assert sorted(picked) == ["a", "a", "b", "b"]


def test_reports_count_other_routers_load():
    a = Replica("a", FakeLoad(LoadReport(waiting=3, running=5)))
    b = Replica("b", FakeLoad(LoadReport(running=1)))
    rs = ReplicaSet([a, b])
    asyncio.run(rs.refresh(timeout=1))
    assert (a.load, b.load) == (8, 1)
    assert rs.pick() is b


def test_failed_or_draining_replicas_get_nothing():
    a = Replica("a", FakeLoad(fail=True))
    b = Replica("b", FakeLoad(LoadReport(serving=False)))
    rs = ReplicaSet([a, b])
    asyncio.run(rs.refresh(timeout=1))
    with pytest.raises(MeshError) as e:
        rs.pick()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    a.client.fail = False
    asyncio.run(rs.refresh(timeout=1))
    assert rs.pick() is a


def test_track_counts_and_releases():
    a = Replica("a", FakeLoad())
    rs = ReplicaSet([a])
    with rs.track(a):
        assert a.inflight == 1
    assert a.inflight == 0
