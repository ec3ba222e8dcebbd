"""Errors of the expert server's domain; the servicer maps each to one gRPC status."""
from __future__ import annotations

import grpc


class UnknownExperts(LookupError):
    """A request names (layer, expert) pairs this server does not hold -> FAILED_PRECONDITION."""


class BadForward(ValueError):
    """A malformed request (shapes, counts, ids) -> INVALID_ARGUMENT."""


class OverBudget(ValueError):
    """Loading would exceed the slot budget -> RESOURCE_EXHAUSTED."""


class CallFailed(Exception):
    """A call that fails with gRPC status `code` and `message` (gRPC Forward, ForwardStream, dist links)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message
