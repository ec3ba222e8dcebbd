"""`RequestMetrics`: an ASGI middleware counting answered requests by endpoint and status."""
from __future__ import annotations

from moemesh.telemetry import ServiceMetrics

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/messages", "/v1/messages/count_tokens",
             "/health", "/metrics", "/api/mesh", "/")


def endpoint_label(path: str) -> str:
    """A known endpoint's path, else "other" (bounded label values)."""
    if path.startswith("/v1/models/"):
        return "/v1/models"
    return path if path in ENDPOINTS else "other"


class RequestMetrics:
    def __init__(self, app, metrics: ServiceMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.metrics.observe_request(endpoint_label(scope["path"]), status["code"])
