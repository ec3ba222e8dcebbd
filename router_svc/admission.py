"""`Admission`: at most `max_running` streams at once and at most `max_queued` waiting for a slot;
a request beyond both is refused at once with RESOURCE_EXHAUSTED instead of piling up."""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import grpc

from moemesh.errors import MeshError


class Admission:
    def __init__(self, max_running: int, max_queued: int) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        if max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {max_queued}")
        self.max_running = max_running
        self.max_queued = max_queued
        self._slots = asyncio.Semaphore(max_running)
        self.running = 0
        self.queued = 0

    @asynccontextmanager
    async def slot(self):
        """Holds one running slot for the body; waits in the bounded queue if all are taken."""
        if self._slots.locked() and self.queued >= self.max_queued:
            raise MeshError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request: the router is full ({self.running} running, {self.queued} queued); retry later",
            )
        self.queued += 1
        try:
            await self._slots.acquire()
        finally:
            self.queued -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()
