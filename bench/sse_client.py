"""A lean HTTP/1.1 client for streamed (server-sent events) POSTs, for benchmarks.

`SseConnection` holds one keep-alive connection (asyncio streams); `post_events(path, body)` sends
one request in one write and yields the JSON object of every `data: {...}` event as it arrives.
It reads what a streamed gateway answer is: a `Transfer-Encoding: chunked` (or `Content-Length`)
body of `data:` lines. A general client such as httpx spends several times the CPU per request and
per event in Python; in a benchmark whose client shares the machine with the server that CPU comes
out of what is measured, so the bench's HTTP side uses this one, as cheap as its gRPC side.
"""
from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator


class HttpError(RuntimeError):
    """A non-200 answer: its status and the start of its body."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:300].decode(errors='replace')}")
        self.status = status


class SseConnection:
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def open(self) -> "SseConnection":
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            await self._writer.wait_closed()
            self._reader = self._writer = None

    async def post_events(self, path: str, body: dict) -> AsyncIterator[dict]:
        """POSTs `body` as JSON; yields each `data: {...}` event's object (`data: [DONE]` ends it)."""
        if self._writer is None:
            await self.open()
        payload = json.dumps(body, separators=(",", ":")).encode()
        self._writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
        status, chunked, length, keep = await self._head()
        if status != 200:
            data = await self._body(chunked, length)
            if not keep:
                await self.close()
            raise HttpError(status, data)
        pending = b""
        async for data in self._pieces(chunked, length):
            pending += data
            *events, pending = pending.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data: {"):
                        yield json.loads(line[6:])
        if not keep:
            await self.close()

    async def _head(self) -> tuple[int, bool, int | None, bool]:
        head = await self._reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        chunked, length, keep = False, None, True
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "transfer-encoding":
                chunked = "chunked" in value
            elif name == "content-length":
                length = int(value)
            elif name == "connection":
                keep = value != "close"
        return status, chunked, length, keep

    async def _pieces(self, chunked: bool, length: int | None) -> AsyncIterator[bytes]:
        """The body as it arrives: each chunk of a chunked body, else `length` bytes (or up to EOF)."""
        r = self._reader
        if chunked:
            while True:
                size = int((await r.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                if size == 0:
                    await r.readuntil(b"\r\n")  # no trailers are sent: the empty line
                    return
                data = await r.readexactly(size + 2)
                yield data[:-2]
        elif length is not None:
            yield await r.readexactly(length)
        else:
            yield await r.read()

    async def _body(self, chunked: bool, length: int | None) -> bytes:
        return b"".join([piece async for piece in self._pieces(chunked, length)])
