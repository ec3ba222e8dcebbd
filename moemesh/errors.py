"""`MeshError`: the one error type of the mesh's services, carrying the gRPC status it maps to.

Domain classes raise it with a `grpc.StatusCode` and a message that starts with the offending field
(`"max_new_tokens: must be >= 1"`); servicers abort the call with exactly that status and message,
clients rebuild it from a failed call (`from_rpc_error`). A failed call to one expert server also
names that server (`server_id`, `address`), so a caller can fail over.
"""
from __future__ import annotations

import grpc

# Exceptions that mean "a flag, file or value given was bad": a command prints one line naming it
# and exits with status 2 (ValueError covers ConfigError, CheckpointError, JSON and UTF-8 errors;
# OSError missing or unreadable files and ports that cannot be bound).
USAGE_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError)


class MeshError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, *, server_id: str = "", address: str = "") -> None:
        where = f"expert server {server_id} ({address}): " if server_id else ""
        super().__init__(f"{where}{message}")
        self.code = code
        self.message = message
        self.server_id = server_id
        self.address = address

    def __repr__(self) -> str:
        return f"MeshError({self.code.name}, {str(self)!r})"


def invalid(message: str) -> MeshError:
    """INVALID_ARGUMENT: the request is malformed (message starts with the field)."""
    return MeshError(grpc.StatusCode.INVALID_ARGUMENT, message)


def out_of_range(message: str) -> MeshError:
    """OUT_OF_RANGE: a value is well-formed but beyond what the model or mesh allows."""
    return MeshError(grpc.StatusCode.OUT_OF_RANGE, message)


def from_rpc_error(e: grpc.RpcError, server_id: str = "", address: str = "") -> MeshError:
    """A failed call (sync `grpc.RpcError` or aio `AioRpcError`: both carry code() and details())."""
    return MeshError(e.code(), e.details() or e.code().name, server_id=server_id, address=address)


class ServiceFailed(RuntimeError):
    """Work a service cannot serve without stopped for good (an attention replica's step loop): the
    process turns NOT_SERVING and exits non-zero, so that its supervisor restarts it."""
