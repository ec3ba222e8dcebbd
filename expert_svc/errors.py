"""Errors of the expert server's domain; the servicer maps each to one gRPC status."""
from __future__ import annotations


class UnknownExperts(LookupError):
    """A request names (layer, expert) pairs this server does not hold -> FAILED_PRECONDITION."""


class BadForward(ValueError):
    """A malformed request (shapes, counts, ids) -> INVALID_ARGUMENT."""


class OverBudget(ValueError):
    """Loading would exceed the slot budget -> RESOURCE_EXHAUSTED."""
