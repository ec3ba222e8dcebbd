"""`ForwardStream`: one long-lived `ExpertService.ForwardStream` call carrying many Forward calls.

A unary call per MoE layer and server costs a new HTTP/2 stream, metadata and a server-side call
context each time; over one stream a call is one message each way (measured on loopback: about half
the round-trip time of a unary call). The stream runs on a sync channel with threads, not on an
event loop: the caller's thread queues the request (gRPC's request thread sends it), one reader
thread per stream completes each call's future as its response arrives (in order, matched by
call id), so a call costs two thread hand-offs, not an event-loop wake-up each way (measured in
`bench/mesh_vs_engine.py`: 0.70-0.80x -> 0.79-0.81x of in-process on the 2-core bench machine).
A call that fails on the server answers with its status and the stream goes on; a broken stream,
a call past its deadline (checked every `deadline_tick_s`) or `close()` fail every call still
waiting with UNAVAILABLE / DEADLINE_EXCEEDED / CANCELLED, and the owner opens a new stream for the
next call.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import grpc

from moemesh.transport.base import ExpertServerError, PeerInfo, rpc_error, settle

STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


class ForwardStream:
    def __init__(self, stub, peer: PeerInfo, timeout_s: float) -> None:
        """stub: a sync ExpertServiceStub; timeout_s: how long each call may wait for its answer."""
        self.peer = peer
        self.timeout_s = timeout_s
        self.deadline_tick_s = max(0.02, min(0.5, timeout_s / 4))
        self._requests: queue.SimpleQueue = queue.SimpleQueue()  # None ends the request side
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[Future, Callable[[Any], Any], float]] = {}  # call id -> (future, on_reply, deadline)
        self._lock = threading.Lock()
        self.broken: ExpertServerError | None = None
        self._responses = stub.ForwardStream(iter(self._requests.get, None))
        name = f"forward-stream-{peer.server_id}"
        threading.Thread(target=self._read, name=name, daemon=True).start()
        threading.Thread(target=self._watch_deadlines, name=f"{name}-deadlines", daemon=True).start()

    def call(self, request: Any, on_reply: Callable[[Any], Any]) -> Future:
        """Queues `request` (its call_id is set here); the future resolves to on_reply(response) or
        fails with ExpertServerError carrying the server's status."""
        fut: Future = Future()
        with self._lock:
            if self.broken is not None:
                fut.set_exception(self._failure())
                return fut
            call_id = next(self._ids)
            request.call_id = call_id
            self._waiting[call_id] = (fut, on_reply, time.monotonic() + self.timeout_s)
            self._requests.put(request)
        return fut

    def _read(self) -> None:
        error = ExpertServerError(self.peer.server_id, self.peer.address, "UNAVAILABLE: the server ended the stream", grpc.StatusCode.UNAVAILABLE)
        try:
            for resp in self._responses:
                with self._lock:
                    waiting = self._waiting.pop(resp.call_id, None)
                if waiting is not None:
                    self._answer(waiting[0], waiting[1], resp)
        except grpc.RpcError as e:
            error = rpc_error(self.peer, e)
        self._break(error)

    def _answer(self, fut: Future, on_reply: Callable[[Any], Any], resp: Any) -> None:
        if resp.error_code:
            code = STATUS_BY_VALUE.get(resp.error_code, grpc.StatusCode.UNKNOWN)
            settle(fut, error=ExpertServerError(self.peer.server_id, self.peer.address, f"{code.name}: {resp.error}", code))
            return
        try:
            value = on_reply(resp)
        except Exception as e:  # noqa: BLE001 - e.g. a malformed reply: this call fails, the stream goes on
            settle(fut, error=e)
            return
        settle(fut, value=value)

    def _watch_deadlines(self) -> None:
        while self.broken is None:
            time.sleep(self.deadline_tick_s)
            with self._lock:
                oldest = next(iter(self._waiting.values()), None)  # answered in order: the first is the oldest
            if oldest is not None and time.monotonic() > oldest[2]:
                self._break(ExpertServerError(
                    self.peer.server_id, self.peer.address, f"DEADLINE_EXCEEDED: no answer within {self.timeout_s:.0f}s",
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                ))

    def _failure(self) -> ExpertServerError:
        """A fresh exception for one caller (one instance is not raised in many places at once)."""
        b = self.broken
        return ExpertServerError(b.server_id, b.address, b.detail, b.code)

    def _break(self, error: ExpertServerError) -> None:
        """Fail every waiting call with `error` (the first error wins) and end the stream."""
        with self._lock:
            if self.broken is None:
                self.broken = error
            waiting, self._waiting = self._waiting, {}
        for fut, _, _ in waiting.values():
            settle(fut, error=self._failure())
        self._requests.put(None)
        self._responses.cancel()

    def close(self) -> None:
        self._break(ExpertServerError(self.peer.server_id, self.peer.address, "CANCELLED: transport closed", grpc.StatusCode.CANCELLED))
