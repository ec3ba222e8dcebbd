"""The gateway over raw HTTP: malformed input, methods, unknown paths, auth, body limits, health,
metrics, and a client that goes away (its Generate call is cancelled)."""
from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.gateway_svc.conftest import Running
from tests.gateway_svc.fake_router import script

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path,anthropic", [("/v1/chat/completions", False), ("/v1/completions", False), ("/v1/messages", True),
                                            ("/v1/messages/count_tokens", True)])
@pytest.mark.parametrize("body,message", [(b"{not json", "not valid JSON"), (b"[1, 2]", "must be a JSON object"),
                                          (b"", "body is empty"), (b"\xff\xfe{}", "not UTF-8")])
def test_malformed_bodies_are_400_in_the_api_shape(gw, path, anthropic, body, message):
    r = httpx.post(gw.url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()
    if anthropic:
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error" and message in err["error"]["message"]
    else:
        assert err["error"]["type"] == "invalid_request_error" and message in err["error"]["message"]
        assert set(err["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/chat/completions", 405), ("PUT", "/v1/messages", 405),
                                                ("POST", "/v1/models", 405), ("GET", "/v1/nothing", 404), ("POST", "/v2/chat", 404)])
def test_wrong_methods_and_unknown_paths(gw, method, path, status):
    r = httpx.request(method, gw.url + path)
    assert r.status_code == status
    body = r.json()
    assert ("error" in body) and (body.get("type") == "error") == path.startswith("/v1/messages")


def test_health_follows_the_routers_generation_health(gw):
    assert httpx.get(gw.url + "/health").json()["status"] == "ok"
    gw.loop.run(gw.router.set_serving(False), 10)
    try:
        r = httpx.get(gw.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
    finally:
        gw.loop.run(gw.router.set_serving(True), 10)
    assert httpx.get(gw.url + "/health").status_code == 200


def test_metrics_count_requests_tokens_and_time_to_first_token(gw):
    httpx.post(gw.url + "/v1/chat/completions", json=CHAT)
    httpx.post(gw.url + "/v1/chat/completions", content=b"{")
    text = httpx.get(gw.url + "/metrics").text
    assert 'moemesh_http_requests_total{endpoint="/v1/chat/completions",service="gateway",status="200"}' in text
    assert 'moemesh_http_requests_total{endpoint="/v1/chat/completions",service="gateway",status="400"}' in text
    assert 'moemesh_time_to_first_token_seconds_count{endpoint="/v1/chat/completions",service="gateway"}' in text
    assert 'moemesh_tokens_total{kind="completion",service="gateway"}' in text


def test_the_chat_page_is_served(gw):
    r = httpx.get(gw.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in r.text and "/api/mesh" in r.text


def test_mesh_view_without_a_control_plane_says_so(gw):
    body = httpx.get(gw.url + "/api/mesh").json()
    assert body["available"] is False and "--control" in body["error"]


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def raw_request(port: int, path: str, body: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "stream": true}'),
    ("/v1/messages", b'{"max_tokens": 50, "messages": [{"role": "user", "content": "hi"}], "stream": true}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}'),
    ("/v1/completions", b'{"prompt": "hi"}'),
])
def test_a_client_that_goes_away_cancels_its_generation(gw, path, body):
    gw.reset(script(*["tok"] * 50), delay_s=0.05)  # 2.5 s of tokens
    s = raw_request(gw.port, path, body)
    wait_for(lambda: gw.fake.requests)
    if b'"stream": true' in body:
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
    time.sleep(0.2)
    s.close()
    wait_for(lambda: gw.fake.cancelled == 1, timeout_s=2.0)
    assert gw.fake.finished == 0


def test_body_limit(loop):
    g = Running(loop, max_body_mb=1)
    try:
        r = httpx.post(g.url + "/v1/chat/completions", content=b"{" + b" " * (2 * 1024 * 1024) + b"}")
        assert r.status_code == 413 and r.json()["error"]["message"].startswith("request:")
    finally:
        g.close()


@pytest.fixture(scope="module")
def keyed(loop):
    g = Running(loop, api_key="sekret")
    yield g
    g.close()


@pytest.mark.parametrize("headers,status", [
    ({}, 401), ({"Authorization": "Bearer wrong"}, 401), ({"x-api-key": "nope"}, 401),
    ({"Authorization": "Bearer sekret"}, 200), ({"x-api-key": "sekret"}, 200), ({"authorization": "bearer sekret"}, 200),
])
def test_api_key(keyed, headers, status):
    keyed.reset()
    chat = httpx.post(keyed.url + "/v1/chat/completions", json=CHAT, headers=headers)
    msgs = httpx.post(keyed.url + "/v1/messages", json=MESSAGES, headers=headers)
    mesh = httpx.get(keyed.url + "/api/mesh", headers=headers)
    assert (chat.status_code, msgs.status_code, mesh.status_code) == (status, status, status)
    if status == 401:
        assert chat.json()["error"]["code"] == "invalid_api_key"
        assert msgs.json()["type"] == "error" and msgs.json()["error"]["type"] == "authentication_error"
        assert keyed.fake.requests == []


def test_open_paths_need_no_key(keyed):
    assert httpx.get(keyed.url + "/health").status_code == 200
    assert httpx.get(keyed.url + "/metrics").status_code == 200
    assert httpx.get(keyed.url + "/").status_code == 200


def test_api_key_from_the_environment(monkeypatch):
    from gateway_svc.config import GatewayConfig
    from gateway_svc.server import effective_api_key

    cfg = GatewayConfig(router="127.0.0.1:1")
    assert effective_api_key(cfg, env={"MOEMESH_API_KEY": "k"}) == "k"
    assert effective_api_key(GatewayConfig(router="127.0.0.1:1", api_key="flag"), env={"MOEMESH_API_KEY": "k"}) == "flag"
    assert effective_api_key(cfg, env={}) == ""


def read_chunks(s: socket.socket) -> list[bytes]:
    """The chunks of a chunked HTTP response, read to its end."""
    data = b""
    while not data.endswith(b"\r\n0\r\n\r\n"):
        more = s.recv(65536)
        assert more, "connection closed before the body ended"
        data += more
    body = data.split(b"\r\n\r\n", 1)[1]
    chunks = []
    while True:
        size_line, body = body.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            return chunks
        chunks.append(body[:size])
        body = body[size + 2:]


@pytest.mark.parametrize("path,body,tail", [
    ("/v1/completions", b'{"prompt": "hi", "stream": true, "stream_options": {"include_usage": true}}',
     [b'"finish_reason":"stop"', b'"usage":{', b"data: [DONE]"]),
    ("/v1/messages", b'{"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "stream": true}',
     [b"event: content_block_stop", b"event: message_delta", b"event: message_stop"]),
])
def test_a_streams_text_comes_as_it_is_made_and_its_end_in_one_piece(gw, path, body, tail):
    gw.reset(script("Qx1", "Qx2", "Qx3"), delay_s=0.05)
    s = raw_request(gw.port, path, body)
    try:
        chunks = read_chunks(s)
    finally:
        s.close()
    texts = [c for c in chunks if b"Qx" in c]
    assert len(texts) == 3 and all(c.count(b"data: ") == 1 for c in texts)  # one chunk per response, as it came
    last = chunks[-1]
    assert all(part in last for part in tail) and b"Qx" not in last
