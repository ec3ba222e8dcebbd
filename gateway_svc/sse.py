"""Server-sent events: the body of every streamed answer.

`EventStream` is a StreamingResponse that always closes its body iterator, however the response
ends (finished, client gone, server stopping), so the Generate call behind it is cancelled and the
sequence aborted. A failure after the stream started is sent in the API's error shape, as the
SDKs expect (OpenAI: a `data:` line with an `error` object; Anthropic: an `error` event).
"""
from __future__ import annotations

import json
import logging

from starlette.responses import StreamingResponse

from gateway_svc.errors import ApiError, from_mesh_error
from moemesh.errors import MeshError

log = logging.getLogger(__name__)
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def data_line(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def event_line(name: str, obj) -> str:
    return f"event: {name}\n{data_line(obj)}"


class EventStream(StreamingResponse):
    def __init__(self, content) -> None:
        super().__init__(content, media_type="text/event-stream", headers=HEADERS)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def stream_error(exc: Exception, names: dict | None = None) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, MeshError):
        return from_mesh_error(exc, names)
    log.exception("stream failed", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}")


async def openai_sse(chunks, stream, names: dict | None = None):
    """`data:` lines of OpenAI chunks, then `data: [DONE]`; the Generate call is closed at the end."""
    try:
        async for chunk in chunks:
            yield data_line(chunk)
    except Exception as exc:  # after the 200 was sent: the error goes into the stream
        yield data_line(stream_error(exc, names).openai_body())
    finally:
        await stream.aclose()
    yield "data: [DONE]\n\n"


async def anthropic_sse(events, stream, names: dict | None = None):
    """`event:`/`data:` pairs of an Anthropic message stream; an `error` event on failure."""
    try:
        async for name, data in events:
            yield event_line(name, data)
    except Exception as exc:
        yield event_line("error", stream_error(exc, names).anthropic_body())
    finally:
        await stream.aclose()
