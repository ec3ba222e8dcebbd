"""`ReplicaError`: a sequence the replica refuses, with the gRPC status name it maps to."""
from __future__ import annotations


class ReplicaError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
