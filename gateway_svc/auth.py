"""`ApiKeyAuth`: an ASGI middleware requiring the API key on the API paths.

With a key configured, `/v1/*` and `/api/*` need `Authorization: Bearer KEY` or `x-api-key: KEY`
(401 in the API's error shape otherwise); `/health`, `/metrics` and the chat page stay open (probes
and scrapers; the page asks for the key and sends it with its API calls). Keys are compared in
constant time.
"""
from __future__ import annotations

import hmac
import json

from gateway_svc.errors import ApiError

PROTECTED = ("/v1/", "/api/")


def presented_keys(headers: list[tuple[bytes, bytes]]) -> list[bytes]:
    keys = []
    for name, value in headers:
        low = name.lower()
        if low == b"x-api-key":
            keys.append(value.strip())
        elif low == b"authorization" and value[:7].lower() == b"bearer ":
            keys.append(value[7:].strip())
    return keys


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


class ApiKeyAuth:
    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.key or not scope["path"].startswith(PROTECTED):
            await self.app(scope, receive, send)
            return
        if any(hmac.compare_digest(k, self.key) for k in presented_keys(scope["headers"])):
            await self.app(scope, receive, send)
            return
        err = ApiError(401, "authentication: a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)",
                       code="invalid_api_key")
        body = json.dumps(err.anthropic_body() if is_anthropic_path(scope["path"]) else err.openai_body()).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
