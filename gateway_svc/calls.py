"""`Generations`: the gateway's Generate calls to the router.

`open(req)` waits for the first response before the HTTP response starts, so an error the router
raises before generating (bad input, unknown model, full, no replica) becomes an HTTP error with its
status; afterwards the stream yields the remaining responses. Closing a stream cancels the gRPC call,
which aborts the sequence on its attention replica and frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

import grpc

from moemesh.errors import MeshError
from moemesh.rpc.generation import GenerationClient
from moemesh.telemetry import ServiceMetrics


class ClientGone(Exception):
    """The HTTP client disconnected while its request was being served."""


class GenerationStream:
    """An open Generate call whose first response has arrived; iterate it for every response."""

    def __init__(self, first, rest: AsyncIterator, metrics: ServiceMetrics) -> None:
        self.first = first
        self.finished = False  # the final response (the one with a finish_reason) was handed out
        self._rest = rest
        self._metrics = metrics

    async def __aiter__(self):
        resp = self.first
        while True:
            if resp.finish_reason:
                self.finished = True
                self._metrics.add_tokens(resp.usage.prompt_tokens, resp.usage.completion_tokens)
            yield resp
            if resp.finish_reason:
                return
            try:
                resp = await self._rest.__anext__()
            except StopAsyncIteration:
                raise MeshError(grpc.StatusCode.UNAVAILABLE, "router: the stream ended without a final message") from None

    async def aclose(self) -> None:
        await self._rest.aclose()


class Generations:
    def __init__(self, client: GenerationClient, timeout_s: float, metrics: ServiceMetrics) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.metrics = metrics

    async def open(self, req, endpoint: str) -> GenerationStream:
        """Starts `req`; returns once its first response is in (MeshError if the call fails first)."""
        start = time.perf_counter()
        rest = self.client.generate(req, timeout=self.timeout_s)
        try:
            first = await rest.__anext__()
        except StopAsyncIteration:
            raise MeshError(grpc.StatusCode.UNAVAILABLE, "router: the stream ended without a response") from None
        except BaseException:
            await rest.aclose()
            raise
        if first.token_ids:
            self.metrics.observe_ttft(endpoint, time.perf_counter() - start)
        return GenerationStream(first, rest, self.metrics)

    async def count_tokens(self, req) -> int:
        return await self.client.count_tokens(req, timeout=self.timeout_s)


async def unless_disconnected(receive, work):
    """Awaits `work` (a coroutine) unless the HTTP client disconnects first: then `work` is cancelled
    (closing its Generate call) and ClientGone raised. `receive` is the request's ASGI receive,
    called only after its body was read (it then returns when the client goes away). `work` runs in
    this task (no task of its own): a watcher task cancels it here when the client goes."""
    current = asyncio.current_task()
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass
        gone = True
        current.cancel()

    # once `work` returns the watcher is cancelled before it can run again, so a response that
    # `work` completed (after which receive() also says http.disconnect) cancels nothing
    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise
        if hasattr(current, "uncancel"):  # 3.11+ counts cancel requests; 3.10 has nothing to undo
            current.uncancel()
        raise ClientGone() from None
    finally:
        watcher.cancel()
