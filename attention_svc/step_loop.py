"""`StepLoop`: drives an `LLMEngine` from asyncio.

    while serving: apply queued adds/aborts -> engine.step() in a worker thread -> route outputs

Requests arrive and leave between steps (the engine is only touched by this loop), so the event
loop never blocks on a running step. Each sequence gets an asyncio.Queue of `StepOutput`s; an
exception put on it (a rejected add, a failed step) ends that sequence with an error.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import grpc

from moemesh.engine import SamplingParams
from moemesh.errors import MeshError

log = logging.getLogger(__name__)


class StepLoop:
    def __init__(self, engine, between_steps=lambda: None, on_step=None, wake: asyncio.Event | None = None) -> None:
        self.engine = engine
        self.between_steps = between_steps  # e.g. adopt a staged expert placement
        self.on_step = on_step  # on_step(seconds, sequences) after each step (e.g. ServiceMetrics.observe_step)
        self._adds: list[tuple[str, list[int], SamplingParams]] = []
        self._aborts: list[str] = []
        self._streams: dict[str, asyncio.Queue] = {}
        self._wake = wake or asyncio.Event()  # set: run one iteration even when idle (e.g. a placement to adopt)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self.steps = 0
        self.accepted = 0  # sequences handed to add() since start

    # ---- called by request handlers (event loop thread) -----------------------------------
    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> asyncio.Queue:
        if request_id in self._streams:
            raise MeshError(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {request_id!r} is already running on this replica")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        self._adds.append((request_id, list(prompt_token_ids), params))
        self.accepted += 1
        self._wake.set()
        return queue

    def abort(self, request_id: str) -> bool:
        """Ends the sequence at the next step boundary (freeing its KV blocks); False if unknown."""
        if request_id not in self._streams:
            return False
        self._aborts.append(request_id)
        self._wake.set()
        return True

    def wake(self) -> None:
        """Runs one loop iteration even when idle (e.g. to adopt a new placement)."""
        self._wake.set()

    @property
    def waiting(self) -> int:
        return len(self._adds) + len(self.engine.scheduler.waiting)

    @property
    def running(self) -> int:
        return len(self.engine.scheduler.running)

    # ---- the loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.between_steps()
            self._apply_queued()
            if not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                started = time.perf_counter()
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
                if self.on_step is not None:
                    self.on_step(time.perf_counter() - started, len(outputs))
            except Exception as exc:  # e.g. an expert server went away mid-step
                log.exception("engine step failed")
                self._fail_all(exc)
                continue
            self.steps += 1
            self._route(outputs)

    def _apply_queued(self) -> None:
        adds, self._adds = self._adds, []
        for request_id, ids, params in adds:
            try:
                self.engine.add_request(request_id, ids, params)
            except ValueError as exc:
                self._streams.pop(request_id).put_nowait(MeshError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
        aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            self.engine.abort(request_id)

    def _route(self, outputs) -> None:
        for out in outputs:
            queue = self._streams.get(out.request_id)
            if queue is None:
                continue
            queue.put_nowait(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_all(self, exc: Exception) -> None:
        err = MeshError(grpc.StatusCode.UNAVAILABLE, f"experts: the engine step failed ({exc})")
        for request_id, queue in list(self._streams.items()):
            self.engine.abort(request_id)
            queue.put_nowait(err)
        self._streams.clear()

    def close(self) -> None:
        self._executor.shutdown(wait=True)
