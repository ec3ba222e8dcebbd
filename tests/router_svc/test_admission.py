import asyncio

import pytest

import grpc

from moemesh.errors import MeshError
from router_svc.admission import Admission


def test_queue_bound_refuses_with_resource_exhausted():
    async def main():
        adm = Admission(max_running=1, max_queued=1)
        release = asyncio.Event()
        entered = []

        async def hold(i):
            async with adm.slot():
                entered.append(i)
                await release.wait()

        first = asyncio.create_task(hold(0))
        await asyncio.sleep(0)
        second = asyncio.create_task(hold(1))  # waits in the queue
        await asyncio.sleep(0)
        assert (adm.running, adm.queued) == (1, 1)
        with pytest.raises(MeshError) as e:
            async with adm.slot():
                pass
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        release.set()
        await asyncio.gather(first, second)
        assert entered == [0, 1]
        assert (adm.running, adm.queued) == (0, 0)

    asyncio.run(main())


def test_cancelled_waiter_leaves_the_queue():
    async def main():
        adm = Admission(max_running=1, max_queued=4)
        release = asyncio.Event()

        async def hold():
            async with adm.slot():
                await release.wait()

        holder = asyncio.create_task(hold())
        await asyncio.sleep(0)
        waiter = asyncio.create_task(hold())
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert adm.queued == 0
        release.set()
        await holder
        assert adm.running == 0

    asyncio.run(main())
