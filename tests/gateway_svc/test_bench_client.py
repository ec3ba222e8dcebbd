"""bench/sse_client.py (the gateway bench's HTTP client) against the gateway: streamed events,
errors, and one connection kept for several requests."""
import pytest

from bench.sse_client import HttpError, SseConnection
from tests.gateway_svc.fake_router import script


async def stream(port: int, bodies: list[dict]) -> tuple[list[list[dict]], list]:
    conn = await SseConnection("127.0.0.1", port).open()
    out, errors = [], []
    try:
        for body in bodies:
            try:
                out.append([e async for e in conn.post_events("/v1/completions", body)])
            except HttpError as exc:
                errors.append(exc)
        return out, errors
    finally:
        await conn.close()


def test_streams_events_and_keeps_its_connection(gw, loop):
    gw.reset(script("Hel", "lo", " world"))
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    runs, errors = loop.run(stream(gw.port, [body, {"prompt": "x"}, body]), 30)
    assert not errors and len(runs) == 3
    for events in (runs[0], runs[2]):
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == "Hello world"
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    assert runs[1] == []  # not streamed: one JSON body, no events


def test_an_error_answer_raises_with_its_status(gw, loop):
    runs, errors = loop.run(stream(gw.port, [{"prompt": 5, "stream": True}, {"prompt": [1], "stream": True}]), 30)
    assert [e.status for e in errors] == [400]
    assert "prompt: must be a string or an array of token ids" in str(errors[0])
    assert "".join(e["choices"][0]["text"] for e in runs[0] if e["choices"]) == "Hello world"
