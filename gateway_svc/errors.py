"""`ApiError`: an HTTP error in the shape of the API the client called.

OpenAI: `{"error": {"message", "type", "param", "code"}}`; Anthropic:
`{"type": "error", "error": {"type", "message"}}`. A failed Generation call (`MeshError`) maps its
gRPC status to the HTTP status (`status_for`); messages start with the offending field.
"""
from __future__ import annotations

import grpc

from moemesh.errors import MeshError

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

OPENAI_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
    429: "rate_limit_error", 499: "invalid_request_error", 503: "service_unavailable", 504: "timeout",
}
ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    405: "invalid_request_error", 409: "invalid_request_error", 413: "request_too_large", 415: "invalid_request_error",
    429: "rate_limit_error", 499: "invalid_request_error", 503: "overloaded_error", 504: "timeout_error",
}


# The router's request fields: a message starting with one of them names the field at fault.
REQUEST_FIELDS = frozenset({
    "model", "request_id", "prompt", "prompt_token_ids", "messages", "max_new_tokens", "temperature", "top_p", "top_k",
    "seed", "stop", "stop_token_ids", "tools", "chat_template_kwargs", "top_logprobs", "continue_final_message",
})


class ApiError(Exception):
    """status: HTTP status; param: the request field at fault (OpenAI's `param`), when one is."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": OPENAI_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(self.status, "api_error"), "message": self.message}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def status_for(code: grpc.StatusCode) -> int:
    return HTTP_STATUS.get(code, 500)


def from_mesh_error(exc: MeshError, names: dict[str, str] | None = None) -> ApiError:
    """A failed Generation call as the client sees it: the gRPC status mapped, the router's message
    (which starts with the field) kept; the field becomes `param` where the message names one,
    renamed to the API's own name through `names` (e.g. max_new_tokens -> max_tokens)."""
    status = status_for(exc.code)
    message = exc.message
    head, sep, rest = message.partition(":")
    param = None
    base = head.split("[", 1)[0].split(".", 1)[0]
    if sep and " " not in head and base in REQUEST_FIELDS:
        param = (names or {}).get(base, base) + head[len(base):]
        message = param + sep + rest
    code = "model_not_found" if exc.code == grpc.StatusCode.NOT_FOUND else exc.code.name.lower()
    return ApiError(status, message, param, code)
