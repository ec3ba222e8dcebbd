"""Server-sent events: the body of every streamed answer.

`EventStream` is the response: it writes each piece its body iterator yields as it comes (one
`send`, one socket write), stops when the client goes away (`unless_disconnected`), and always
closes the iterator, however the response ends (finished, client gone, server
stopping), so the Generate call behind it is cancelled and the sequence aborted.

`openai_sse` / `anthropic_sse` make the pieces. Once the router's final message is in, what is left
of the answer (the last chunk, usage, `[DONE]`; or message_delta and message_stop) needs no more
waiting: it goes out as one `Last` piece, written together with the end of the body, so the client
sees the whole end of the answer at once and can send its next request. A failure after the stream
started is sent in the API's error shape, as the SDKs expect (OpenAI: a `data:` line with an
`error` object; Anthropic: an `error` event).
"""
from __future__ import annotations

import json
import logging

from starlette.responses import Response

from gateway_svc.calls import ClientGone, unless_disconnected
from gateway_svc.errors import ApiError, from_mesh_error
from moemesh.errors import MeshError

log = logging.getLogger(__name__)
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def data_line(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def event_line(name: str, obj) -> str:
    return f"event: {name}\n{data_line(obj)}"


class Last(str):
    """The last piece of a stream: written with the end of the body, in one write."""


class EventStream(Response):
    """A `text/event-stream` response over an async iterator of str pieces (ending with a `Last`
    one, or just ending). A Response, so FastAPI hands it to the server as it is."""

    media_type = "text/event-stream"

    def __init__(self, content) -> None:
        self.status_code = 200
        self.background = None
        self.body_iterator = content
        self.init_headers(HEADERS)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await unless_disconnected(receive, self._write(send))
        except ClientGone:
            pass  # nothing more to send
        finally:
            await self.body_iterator.aclose()

    async def _write(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for piece in self.body_iterator:
            if isinstance(piece, Last):
                await send({"type": "http.response.body", "body": piece.encode(), "more_body": False})
                return
            await send({"type": "http.response.body", "body": piece.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def stream_error(exc: Exception, names: dict | None = None) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, MeshError):
        return from_mesh_error(exc, names)
    log.exception("stream failed", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}")


async def openai_sse(chunks, stream, names: dict | None = None):
    """`data:` lines of OpenAI chunks, then `data: [DONE]`; the Generate call is closed at the end.
    Lines made after the router's final message go out with `[DONE]` as one `Last` piece."""
    tail: list[str] = []
    try:
        async for chunk in chunks:
            if stream.finished:
                tail.append(data_line(chunk))
            else:
                yield data_line(chunk)
    except Exception as exc:  # after the 200 was sent: the error goes into the stream
        tail.append(data_line(stream_error(exc, names).openai_body()))
    finally:
        await stream.aclose()
    tail.append("data: [DONE]\n\n")
    yield Last("".join(tail))


async def anthropic_sse(events, stream, names: dict | None = None):
    """`event:`/`data:` pairs of an Anthropic message stream; an `error` event on failure. Events
    made after the router's final message go out as one `Last` piece."""
    tail: list[str] = []
    try:
        async for name, data in events:
            if stream.finished:
                tail.append(event_line(name, data))
            else:
                yield event_line(name, data)
    except Exception as exc:
        tail.append(event_line("error", stream_error(exc, names).anthropic_body()))
    finally:
        await stream.aclose()
    yield Last("".join(tail))
