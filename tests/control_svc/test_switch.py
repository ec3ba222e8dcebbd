import asyncio

import pytest

from control_svc.board import PlacementBoard
from control_svc.switch import PlacementSwitch
from moemesh.contracts.info import ServerInfo
from moemesh.contracts.placement import Placement
from moemesh.errors import MeshError

OLD = Placement(1, {0: (("a",), ("b",), ("a", "b"))})
NEW = Placement(2, {0: (("b",), ("b",), ("a",))})
SERVERS = {s: ServerInfo(s, f"127.0.0.1:{i + 1}") for i, s in enumerate("abc")}


class FakeOps:
    def __init__(self, board, fail=False):
        self.board = board
        self.fail = fail
        self.log = []

    async def load(self, server, experts, version):
        self.log.append(("load", server.server_id, experts, self.board.version))
        if self.fail:
            raise ConnectionError(f"{server.server_id} is down")

    async def drop(self, server, experts, version):
        self.log.append(("drop", server.server_id, experts, self.board.version))


def test_prepare_commit_release_order():
    async def main():
        board = PlacementBoard()
        adopted = {"r": None}
        ops = FakeOps(board)
        sw = PlacementSwitch(ops, board, lambda: SERVERS, lambda: list(adopted.values()), 5.0, 5.0)
        await sw.switch(OLD)
        assert board.version == 1 and [e[0] for e in ops.log] == ["load", "load"]
        assert all(e[3] == 0 for e in ops.log)  # loaded before the commit
        adopted["r"] = 1
        ops.log.clear()
        task = asyncio.create_task(sw.switch(NEW))
        await asyncio.sleep(0.2)
        assert board.version == 2  # committed
        assert [e[0] for e in ops.log] == ["load"]  # but nothing dropped while the replica runs v1
        adopted["r"] = 2
        await asyncio.wait_for(task, 5)
        drops = sorted((e[1], e[2]) for e in ops.log if e[0] == "drop")
        assert drops == [("a", {0: (0,)}), ("b", {0: (2,)})]

    asyncio.run(main())


def test_failed_prepare_keeps_the_old_placement():
    async def main():
        board = PlacementBoard()
        sw = PlacementSwitch(FakeOps(board, fail=True), board, lambda: SERVERS, lambda: [], 5.0, 5.0)
        with pytest.raises(MeshError, match="down"):
            await sw.switch(OLD)
        assert board.version == 0
        with pytest.raises(MeshError, match="unknown servers"):
            await sw.switch(Placement(1, {0: (("zz",),)}))

    asyncio.run(main())


def test_watchers_see_each_commit():
    async def main():
        board = PlacementBoard()
        sw = PlacementSwitch(FakeOps(board), board, lambda: SERVERS, lambda: [], 5.0, 0.1)
        seen = []

        async def watch():
            async for view in board.watch(0):
                seen.append(view.placement.version)
                if view.placement.version == 2:
                    return

        w = asyncio.create_task(watch())
        await asyncio.sleep(0.05)
        await sw.switch(OLD)
        await asyncio.sleep(0.05)
        await sw.switch(NEW)
        await asyncio.wait_for(w, 5)
        assert seen == [1, 2]
        with pytest.raises(ValueError, match="version"):
            await sw.board.publish(board.current)

    asyncio.run(main())


def test_prepare_loads_exactly_the_diff_and_reports_its_rate():
    from control_svc.placement import placement_diff

    async def main():
        board = PlacementBoard()
        ops = FakeOps(board)
        rates = []
        sw = PlacementSwitch(ops, board, lambda: SERVERS, lambda: [2], 5.0, 5.0, on_loaded=lambda n, s: rates.append((n, s)))
        await sw.switch(OLD)
        ops.log.clear()
        rates.clear()
        new = Placement(2, {0: (("a", "c"), ("b",), ("a", "b"))})  # one copy added on c, nothing else moves
        await sw.switch(new)
        loads = {e[1]: e[2] for e in ops.log if e[0] == "load"}
        assert loads == placement_diff(OLD, new).loads == {"c": {0: (0,)}}
        assert [n for n, _ in rates] == [1] and rates[0][1] >= 0

        async def reporting(server, experts, version):  # a server that says how long it spent loading
            ops.log.append(("load", server.server_id, experts, board.version))
            await asyncio.sleep(0.2)  # a pause between its layers: not loading time
            return 0.01

        ops.load = reporting
        rates.clear()
        await sw.switch(Placement(3, {0: (("a", "c"), ("b", "c"), ("a", "b"))}))
        assert rates == [(1, 0.01)]

    asyncio.run(main())
