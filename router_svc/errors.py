"""`RequestError`: a request the router cannot serve, with the gRPC status it maps to.

`code` is a `grpc.StatusCode` name ("INVALID_ARGUMENT", "OUT_OF_RANGE", ...), so the domain
classes stay free of gRPC; the servicer turns it into the status. Messages start with the field.
"""
from __future__ import annotations


class RequestError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"RequestError({self.code}, {self.message!r})"


def invalid(message: str) -> RequestError:
    return RequestError("INVALID_ARGUMENT", message)


def out_of_range(message: str) -> RequestError:
    return RequestError("OUT_OF_RANGE", message)
