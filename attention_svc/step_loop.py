"""`StepLoop`: drives an `LLMEngine` from asyncio.

    while serving: apply queued aborts/adds -> engine.step() in a worker thread -> route outputs

Requests arrive and leave between steps (the engine is only touched by this loop), so the event
loop never blocks on a running step. Each sequence gets an asyncio.Queue of `StepOutput`s; an
exception put on it (a rejected add, a failed step, a sequence that failed alone) ends that
sequence with an error.

What fails what:
- a rejected add fails that sequence (INVALID_ARGUMENT, or the status its error maps to);
- a sequence whose logits or sampling fail gets the engine's "error" output: that sequence alone
  ends (INVALID_ARGUMENT for its own bad values, INTERNAL otherwise), its batch mates go on;
- a failed model run (`StepFailed`) ends the sequences of that step's batch: UNAVAILABLE
  "experts: ..." when an expert call failed (the router may try another replica), INTERNAL
  "engine: ..." for anything else; queued and waiting sequences go on;
- an error of the loop's own bookkeeping fails the engine's sequences and the loop goes on; after
  `MAX_LOOP_ERRORS` in a row it ends (raises), so the server turns NOT_SERVING and the process
  exits to be restarted (see attention_svc/server.py).

Each sequence runs in the engine under a key of its own (`request_id#n`), so a request id is free
again the moment its sequence is aborted, even before the engine's next step drops it.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Sequence

import grpc

from moemesh.engine import SamplingParams, StepFailed, StepOutput
from moemesh.errors import MeshError

log = logging.getLogger(__name__)

MAX_LOOP_ERRORS = 5  # consecutive failures outside the engine step before the loop gives up


@dataclass(eq=False)
class _Stream:
    request_id: str  # the client's id
    key: str  # the engine's id of this sequence
    queue: asyncio.Queue


def is_expert_failure(exc: BaseException | None) -> bool:
    """Whether `exc` (or what caused it) is a failed call to an expert server: the expert path's
    errors name the server (`MeshError.server_id`)."""
    seen = 0
    while exc is not None and seen < 16:
        if getattr(exc, "server_id", ""):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def step_error(exc: BaseException) -> MeshError:
    """The status of the sequences of a failed step: UNAVAILABLE only for a failed expert call."""
    if is_expert_failure(exc):
        return MeshError(grpc.StatusCode.UNAVAILABLE, f"experts: the engine step failed ({exc})")
    return MeshError(grpc.StatusCode.INTERNAL, f"engine: the step failed ({type(exc).__name__}: {exc})")


def sequence_error(exc: Exception) -> MeshError:
    """The status of one sequence that failed alone: INVALID_ARGUMENT for its own values, else INTERNAL.
    The engine's messages start with what failed ("temperature: ...", "logits: ...")."""
    if isinstance(exc, MeshError):
        return exc
    code = grpc.StatusCode.INVALID_ARGUMENT if isinstance(exc, ValueError) else grpc.StatusCode.INTERNAL
    return MeshError(code, str(exc) or type(exc).__name__)


class StepLoop:
    def __init__(self, engine, between_steps=lambda: None, on_step=None, wake: asyncio.Event | None = None) -> None:
        self.engine = engine
        self.between_steps = between_steps  # e.g. adopt a staged expert placement
        self.on_step = on_step  # on_step(seconds, sequences) after each step (e.g. ServiceMetrics.observe_step)
        self._adds: list[tuple[_Stream, Sequence[int], SamplingParams]] = []
        self._aborts: list[str] = []  # engine keys
        self._by_id: dict[str, _Stream] = {}  # client request id -> its live sequence
        self._by_key: dict[str, _Stream] = {}  # engine key -> the same, once handed to the engine
        self._keys = itertools.count()
        self._wake = wake or asyncio.Event()  # set: run one iteration even when idle (e.g. a placement to adopt)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self.steps = 0
        self.accepted = 0  # sequences handed to add() since start

    # ---- called by request handlers (event loop thread) -----------------------------------
    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> asyncio.Queue:
        if request_id in self._by_id:
            raise MeshError(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {request_id!r} is already running on this replica")
        stream = _Stream(request_id, f"{request_id}#{next(self._keys)}", asyncio.Queue())
        self._by_id[request_id] = stream
        self._adds.append((stream, prompt_token_ids, params))
        self.accepted += 1
        self._wake.set()
        return stream.queue

    def abort(self, request_id: str) -> bool:
        """Ends the sequence now: its stream gets a final "abort" output and the id is free at once;
        the engine drops it (freeing its KV blocks) at the next step boundary. False if unknown."""
        stream = self._by_id.pop(request_id, None)
        if stream is None:
            return False
        if self._by_key.pop(stream.key, None) is not None:
            self._aborts.append(stream.key)
        else:  # still queued: never reaches the engine
            self._adds = [a for a in self._adds if a[0] is not stream]
        stream.queue.put_nowait(StepOutput(request_id, None, None, True, "abort"))
        self._wake.set()
        return True

    def wake(self) -> None:
        """Runs one loop iteration even when idle (e.g. to adopt a new placement)."""
        self._wake.set()

    def fail_all(self, err: MeshError) -> None:
        """Ends every sequence, queued or running, with `err` (the loop is going away)."""
        for stream in list(self._by_id.values()):  # the engine is left alone: a step may still be running
            self._forget(stream)
            stream.queue.put_nowait(err)
        self._adds = []

    @property
    def waiting(self) -> int:
        return len(self._adds) + len(self.engine.scheduler.waiting)

    @property
    def running(self) -> int:
        return len(self.engine.scheduler.running)

    # ---- the loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        """Serves until cancelled. Raises only after MAX_LOOP_ERRORS consecutive errors outside the
        engine step (a failed step is handled and counts as none)."""
        errors = 0
        while True:
            try:
                await self._iterate()
                errors = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                errors += 1
                log.exception("step loop error (%d in a row)", errors)
                self._fail_engine_streams(MeshError(grpc.StatusCode.INTERNAL, f"engine: the step loop failed ({type(exc).__name__}: {exc})"))
                if errors >= MAX_LOOP_ERRORS:
                    raise
                await asyncio.sleep(0.01 * 2**errors)

    async def _iterate(self) -> None:
        self.between_steps()
        self._apply_queued()
        if not self.engine.has_unfinished():
            self._wake.clear()
            await self._wake.wait()
            return
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        try:
            outputs = await loop.run_in_executor(self._executor, self.engine.step)
        except StepFailed as exc:  # e.g. an expert server went away mid-step
            log.error("engine step failed for %d sequences: %s", len(exc.request_ids), exc.cause)
            err = step_error(exc.cause)
            for key in exc.request_ids:
                stream = self._by_key.get(key)
                if stream is not None:
                    self._end(stream, err)
            return
        if self.on_step is not None:
            self.on_step(time.perf_counter() - started, len(outputs))
        self.steps += 1
        self._route(outputs)

    def _apply_queued(self) -> None:
        aborts, self._aborts = self._aborts, []
        for key in aborts:
            self.engine.abort(key)
        adds, self._adds = self._adds, []
        for stream, ids, params in adds:
            if self._by_id.get(stream.request_id) is not stream:  # aborted or failed meanwhile
                continue
            try:
                self.engine.add_request(stream.key, ids, params)
            except Exception as exc:  # the engine refused this sequence: it alone fails
                self._end(stream, sequence_error(exc))
                continue
            self._by_key[stream.key] = stream

    def _route(self, outputs) -> None:
        for out in outputs:
            stream = self._by_key.get(out.request_id)
            if stream is None:  # aborted: its stream already ended
                continue
            if out.error is not None:
                self._end(stream, sequence_error(out.error))
                continue
            stream.queue.put_nowait(replace(out, request_id=stream.request_id))
            if out.finished:
                self._forget(stream)

    def _end(self, stream: _Stream, err: MeshError) -> None:
        """Ends one sequence with `err`; the engine drops it if it still holds it."""
        if self._by_key.get(stream.key) is stream:
            self.engine.abort(stream.key)
        self._forget(stream)
        stream.queue.put_nowait(err)

    def _forget(self, stream: _Stream) -> None:
        self._by_key.pop(stream.key, None)
        if self._by_id.get(stream.request_id) is stream:
            del self._by_id[stream.request_id]

    def _fail_engine_streams(self, err: MeshError) -> None:
        """After an error outside the step: ends the sequences the engine holds; queued ones wait."""
        for stream in list(self._by_key.values()):
            try:
                self._end(stream, err)
            except Exception:  # noqa: BLE001 - the engine may be the broken part; the stream still ends
                self._forget(stream)
                stream.queue.put_nowait(err)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
