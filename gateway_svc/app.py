"""The gateway's HTTP app: routes, error shapes, auth and request metrics (FastAPI).

Handlers only translate: JSON -> GenerateRequest (the `openai_*` / `anthropic_*` modules), a call
through `Generations`, responses -> JSON or server-sent events. Errors come back in the shape of the
API the path belongs to (`/v1/messages*`: Anthropic; everything else: OpenAI).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.responses import FileResponse, JSONResponse, Response

from gateway_svc import anthropic_messages, openai_chat, openai_completions
from gateway_svc.auth import ApiKeyAuth, is_anthropic_path
from gateway_svc.body import read_json
from gateway_svc.calls import ClientGone, Generations, unless_disconnected
from gateway_svc.common import collect
from gateway_svc.errors import ApiError, from_mesh_error
from gateway_svc.mesh_view import MeshView
from gateway_svc.parsing import OutputParser
from gateway_svc.request_metrics import RequestMetrics
from gateway_svc.sse import EventStream, anthropic_sse, openai_sse
from moemesh.errors import MeshError
from moemesh.rpc.generation import GenerationClient
from moemesh.telemetry import ServiceMetrics

log = logging.getLogger(__name__)
PAGE = Path(__file__).resolve().parent / "static" / "index.html"
CLIENT_CLOSED = 499  # nginx's code for a client that went away: nothing is sent


@dataclass
class Gateway:
    """What the handlers share: the router client, the served model, parsers' settings, metrics."""

    client: GenerationClient
    info: object  # moemesh.v1.ModelInfo
    served: str
    calls: Generations
    mesh: MeshView
    metrics: ServiceMetrics
    max_body_bytes: int
    reasoning: bool
    tools: bool
    started: int = 0

    def parser(self, tools_offered: bool) -> OutputParser:
        return OutputParser(reasoning=self.reasoning, tools=self.tools and tools_offered)

    async def open(self, request: Request, req, endpoint: str, names: dict):
        """Starts the generation; its first response is in when this returns."""
        try:
            return await unless_disconnected(request.receive, self.calls.open(req, endpoint))
        except MeshError as exc:
            raise from_mesh_error(exc, names) from exc

    async def finish(self, request: Request, work, stream, names: dict):
        """Awaits a non-streamed answer, closing the call when the client goes away."""
        try:
            return await unless_disconnected(request.receive, work)
        except MeshError as exc:
            raise from_mesh_error(exc, names) from exc
        finally:
            await stream.aclose()


def error_response(path: str, err: ApiError) -> JSONResponse:
    body = err.anthropic_body() if is_anthropic_path(path) else err.openai_body()
    return JSONResponse(body, status_code=err.status)


def build_app(gw: Gateway, api_key: str = ""):
    """The ASGI app: FastAPI routes inside the API-key check inside the request counter."""
    app = FastAPI(title="moemesh gateway", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return error_response(request.url.path, exc)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone):
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        message = {404: f"{request.url.path}: no such endpoint",
                   405: f"{request.url.path}: method {request.method} not allowed"}.get(exc.status_code, str(exc.detail))
        resp = error_response(request.url.path, ApiError(exc.status_code, message))
        for k, v in (exc.headers or {}).items():
            resp.headers[k] = v
        return resp

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(request.url.path, ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req, opts = openai_chat.parse(await read_json(request, gw.max_body_bytes), gw.served)
        parser = gw.parser(opts.tools)
        stream = await gw.open(request, req, "/v1/chat/completions", openai_chat.NAMES)
        if opts.stream:
            return EventStream(openai_sse(openai_chat.chunks(stream, opts, parser), stream, openai_chat.NAMES))
        result = await gw.finish(request, collect(stream, parser), stream, openai_chat.NAMES)
        return JSONResponse(openai_chat.completion(result, opts))

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, opts = openai_completions.parse(await read_json(request, gw.max_body_bytes), gw.served)
        names = openai_completions.NAMES
        stream = await gw.open(request, req, "/v1/completions", names)
        if opts.stream:
            return EventStream(openai_sse(openai_completions.chunks(stream, opts), stream, names))
        return JSONResponse(await gw.finish(request, openai_completions.complete(stream, opts), stream, names))

    @app.post("/v1/messages")
    async def messages(request: Request):
        req, opts = anthropic_messages.parse(await read_json(request, gw.max_body_bytes), gw.served)
        parser = gw.parser(opts.tools)
        names = anthropic_messages.NAMES
        stream = await gw.open(request, req, "/v1/messages", names)
        if opts.stream:
            return EventStream(anthropic_sse(anthropic_messages.events(stream, opts, parser), stream, names))
        result = await gw.finish(request, collect(stream, parser), stream, names)
        return JSONResponse(anthropic_messages.message(result, opts))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        req = anthropic_messages.parse_count(await read_json(request, gw.max_body_bytes), gw.served)
        try:
            n = await gw.calls.count_tokens(req)
        except MeshError as exc:
            raise from_mesh_error(exc, anthropic_messages.NAMES) from exc
        return {"input_tokens": n}

    def model_card(request: Request) -> dict:
        if request.headers.get("anthropic-version"):
            created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(gw.started))
            return {"type": "model", "id": gw.served, "display_name": gw.served, "created_at": created}
        return {"id": gw.served, "object": "model", "created": gw.started, "owned_by": "moemesh",
                "root": gw.served, "max_model_len": gw.info.max_context}

    @app.get("/v1/models")
    async def models(request: Request):
        card = model_card(request)
        if request.headers.get("anthropic-version"):
            return {"data": [card], "has_more": False, "first_id": gw.served, "last_id": gw.served}
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        if model_id != gw.served:
            raise ApiError(404, f"model: the model {model_id!r} does not exist; this server serves {gw.served!r}",
                           "model", "model_not_found")
        return model_card(request)

    @app.get("/health")
    async def health():
        if await gw.client.serving():
            return {"status": "ok", "model": gw.served}
        return JSONResponse({"status": "unavailable", "model": gw.served,
                             "reason": "the router has no attention replica that can serve, or does not answer"},
                            status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(gw.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/api/mesh")
    async def mesh():
        return await gw.mesh.snapshot()

    @app.get("/")
    async def page():
        return FileResponse(PAGE, media_type="text/html", headers={"Cache-Control": "no-cache"})

    return RequestMetrics(ApiKeyAuth(app, api_key), gw.metrics)
