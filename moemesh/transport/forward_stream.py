"""`ForwardStream`: one long-lived `ExpertService.ForwardStream` call carrying many Forward calls.

A unary call per MoE layer and server costs a new HTTP/2 stream, metadata and a server-side call
context each time; over one stream a call is one message each way (measured on loopback: about half
the round-trip time of a unary call). Lives on the transport's event loop. Each call gets an id;
responses (in order) are matched by it. A call that fails on the server answers with its status and
the stream goes on; a broken stream, a call past its deadline or `close()` fail every call still
waiting (with UNAVAILABLE / DEADLINE_EXCEEDED / CANCELLED), and the owner opens a new stream for the
next call.
"""
from __future__ import annotations

import asyncio
import itertools
from typing import Any, Callable

import grpc

from moemesh.transport.base import ExpertServerError, PeerInfo, rpc_error

STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


class ForwardStream:
    def __init__(self, stub, peer: PeerInfo) -> None:
        """stub: the aio ExpertServiceStub (call on the loop thread)."""
        self.peer = peer
        self._call = stub.ForwardStream()
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._write_lock = asyncio.Lock()  # an aio stream takes one write at a time
        self.broken: ExpertServerError | None = None
        self._reader = asyncio.ensure_future(self._read())

    async def call(self, request: Any, timeout_s: float, on_reply: Callable[[Any], Any]) -> Any:
        """Sends `request` (its call_id is set here) and returns on_reply(response); a failed call
        raises ExpertServerError with the server's status."""
        if self.broken is not None:
            raise self._failure()
        call_id = next(self._ids)
        request.call_id = call_id
        reply = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = reply
        try:
            async with self._write_lock:
                await self._call.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as e:
            self._waiting.pop(call_id, None)
            self._break(self._error_of(e))
            raise self._failure() from None
        try:
            resp = await asyncio.wait_for(reply, timeout_s)
        except asyncio.TimeoutError:
            self._break(ExpertServerError(
                self.peer.server_id, self.peer.address, f"DEADLINE_EXCEEDED: no answer within {timeout_s:.0f}s",
                grpc.StatusCode.DEADLINE_EXCEEDED,
            ))
            raise self._failure() from None
        if resp.error_code:
            code = STATUS_BY_VALUE.get(resp.error_code, grpc.StatusCode.UNKNOWN)
            raise ExpertServerError(self.peer.server_id, self.peer.address, f"{code.name}: {resp.error}", code)
        return on_reply(resp)

    async def _read(self) -> None:
        error: ExpertServerError | None = None
        try:
            while True:
                resp = await self._call.read()
                if resp is grpc.aio.EOF:
                    break
                reply = self._waiting.pop(resp.call_id, None)
                if reply is not None and not reply.done():
                    reply.set_result(resp)
        except asyncio.CancelledError:
            error = ExpertServerError(self.peer.server_id, self.peer.address, "CANCELLED: stream closed", grpc.StatusCode.CANCELLED)
        except grpc.aio.AioRpcError as e:
            error = rpc_error(self.peer, e)
        self._break(error or ExpertServerError(
            self.peer.server_id, self.peer.address, "UNAVAILABLE: the server ended the stream", grpc.StatusCode.UNAVAILABLE,
        ))

    def _failure(self) -> ExpertServerError:
        """A fresh exception for one caller (one instance is not raised in many places at once)."""
        b = self.broken
        return ExpertServerError(b.server_id, b.address, b.detail, b.code)

    def _error_of(self, e: BaseException) -> ExpertServerError:
        if isinstance(e, grpc.aio.AioRpcError):
            return rpc_error(self.peer, e)
        return ExpertServerError(self.peer.server_id, self.peer.address, f"UNAVAILABLE: stream write failed ({e})", grpc.StatusCode.UNAVAILABLE)

    def _break(self, error: ExpertServerError) -> None:
        """Fail every waiting call with `error` and stop the stream (the owner opens a new one)."""
        if self.broken is None:
            self.broken = error
        waiting, self._waiting = self._waiting, {}
        for reply in waiting.values():
            if not reply.done():
                reply.set_exception(self._failure())
                reply.exception()  # its caller may be gone (e.g. timed out): no "never retrieved" noise
        self._call.cancel()

    def close(self) -> None:
        self._break(ExpertServerError(self.peer.server_id, self.peer.address, "CANCELLED: transport closed", grpc.StatusCode.CANCELLED))
        self._reader.cancel()
