"""`GrpcTransport`: one expert server's calls over one long-lived `ExpertService.ForwardStream`.

Shape legend: T_s tokens sent, H hidden.

A unary call per MoE layer and server would cost a new HTTP/2 stream, metadata and a server-side
call context each time; over one stream a call is one message each way. The stream runs on a sync
channel with threads, not on an event loop: the caller's thread queues the request (gRPC's request
thread sends it), one reader thread per stream completes each call's future as its response arrives
(in order, matched by call id), a watchdog thread checks the oldest call's deadline every
`deadline_tick_s`. A call that fails on the server answers with its status and the stream goes on;
a broken stream, a call past its deadline or `close()` fail every call still waiting with
UNAVAILABLE / DEADLINE_EXCEEDED / CANCELLED, and the next call opens a new stream.
The stub (`stub()`) also serves `DistTransport`'s `OpenDistLink`.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from moemesh.errors import MeshError, from_rpc_error
from moemesh.rpc.config import RpcConfig
from moemesh.rpc.protos import load
from moemesh.rpc.server import make_sync_channel
from moemesh.transport.base import ExpertRequest, PeerInfo, peer_error, settle
from moemesh.transport.codec import CodecError, decode, encode

expert_pb2, expert_grpc = load("expert")

STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


@dataclass(frozen=True)
class _Call:
    """A call waiting for its response: where the reply goes and what it must look like."""

    future: Future
    shape: tuple[int, ...]  # y's: x's [T_s, H]
    device: torch.device
    deadline: float


@dataclass
class _Stream:
    """One open ForwardStream: the request queue its call reads (None ends it), the response
    iterator, the calls waiting (answered in order, so the first is the oldest)."""

    requests: queue.SimpleQueue
    responses: Any
    waiting: dict[int, _Call] = field(default_factory=dict)
    broken: MeshError | None = None


def request_message(req: ExpertRequest):
    """`req` as a moemesh.v1.ForwardRequest."""
    msg = expert_pb2.ForwardRequest(
        layer=req.layer, placement_version=req.placement_version, expert_ids=req.expert_ids.tolist(), counts=req.counts.tolist(),
    )
    encode(req.x, out=msg.x)
    encode(req.token_idx.to(torch.int32), out=msg.token_idx)
    encode(req.weights.to(torch.float32), out=msg.weights)
    return msg


class GrpcTransport:
    def __init__(self, peer: PeerInfo, rpc: RpcConfig, timeout_s: float = 60.0):
        """timeout_s: how long each call may wait for its answer."""
        self.peer = peer
        self.server_id = peer.server_id
        self.rpc = rpc
        self.timeout_s = timeout_s
        self.deadline_tick_s = max(0.02, min(0.5, timeout_s / 4))
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub = None
        self._stream: _Stream | None = None
        self._ids = itertools.count(1)
        self._closed = False

    def stub(self):
        """The sync stub, its channel opened on first use."""
        with self._lock:
            return self._stub_locked()

    def _stub_locked(self):
        if self._closed:
            raise peer_error(self.peer, grpc.StatusCode.CANCELLED, "transport closed")
        if self._stub is None:
            self._channel = make_sync_channel(self.peer.address, self.rpc)  # ValueError for an address that is not host:port
            self._stub = expert_grpc.ExpertServiceStub(self._channel)
        return self._stub

    def forward(self, req: ExpertRequest) -> Future:
        """Future of y [T_s, H] in req.x.dtype on req.x.device (see `ExpertTransport`)."""
        msg = request_message(req)
        fut: Future = Future()
        with self._lock:
            try:
                stream = self._open_stream_locked()
            except MeshError as e:
                fut.set_exception(e)
                return fut
            msg.call_id = call_id = next(self._ids)
            stream.waiting[call_id] = _Call(fut, tuple(req.x.shape), req.x.device, time.monotonic() + self.timeout_s)
            stream.requests.put(msg)
        return fut

    def _open_stream_locked(self) -> _Stream:
        """The open stream, or a new one (with its reader and watchdog threads) after a failure."""
        if self._stream is not None and self._stream.broken is None:
            return self._stream
        requests: queue.SimpleQueue = queue.SimpleQueue()
        stream = _Stream(requests, self._stub_locked().ForwardStream(iter(requests.get, None)))
        self._stream = stream
        name = f"forward-stream-{self.server_id}"
        threading.Thread(target=self._read, args=(stream,), name=name, daemon=True).start()
        threading.Thread(target=self._watch_deadlines, args=(stream,), name=f"{name}-deadlines", daemon=True).start()
        return stream

    def _read(self, stream: _Stream) -> None:
        error = peer_error(self.peer, grpc.StatusCode.UNAVAILABLE, "the server ended the stream")
        try:
            for resp in stream.responses:
                with self._lock:
                    call = stream.waiting.pop(resp.call_id, None)
                if call is not None:
                    self._answer(call, resp)
        except grpc.RpcError as e:
            error = from_rpc_error(e, self.peer.server_id, self.peer.address)
        self._break(stream, error)

    def _answer(self, call: _Call, resp: Any) -> None:
        if resp.error_code:
            code = STATUS_BY_VALUE.get(resp.error_code, grpc.StatusCode.UNKNOWN)
            settle(call.future, error=peer_error(self.peer, code, resp.error))
            return
        try:
            y = decode(resp.y, field="y", ndim=2)
        except CodecError as e:  # this call fails, the stream goes on
            settle(call.future, error=peer_error(self.peer, grpc.StatusCode.INTERNAL, f"bad reply: {e}"))
            return
        if tuple(y.shape) != call.shape:
            settle(call.future, error=peer_error(self.peer, grpc.StatusCode.INTERNAL, f"reply y has shape {list(y.shape)}, expected {list(call.shape)}"))
            return
        settle(call.future, value=y.to(call.device))

    def _watch_deadlines(self, stream: _Stream) -> None:
        while stream.broken is None:
            time.sleep(self.deadline_tick_s)
            with self._lock:
                oldest = next(iter(stream.waiting.values()), None)
            if oldest is not None and time.monotonic() > oldest.deadline:
                self._break(stream, peer_error(self.peer, grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {self.timeout_s:.0f}s"))

    def _break(self, stream: _Stream, error: MeshError) -> None:
        """Fail every call waiting on `stream` with `error` (the first error wins) and end it."""
        with self._lock:
            if stream.broken is None:
                stream.broken = error
            waiting, stream.waiting = stream.waiting, {}
            broken = stream.broken
        for call in waiting.values():  # a fresh exception per caller: one instance is never raised in many places at once
            settle(call.future, error=MeshError(broken.code, broken.message, server_id=broken.server_id, address=broken.address))
        stream.requests.put(None)
        stream.responses.cancel()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            stream, channel = self._stream, self._channel
            self._stream = self._channel = self._stub = None
        if stream is not None:
            self._break(stream, peer_error(self.peer, grpc.StatusCode.CANCELLED, "transport closed"))
        if channel is not None:
            channel.close()
