"""`ExpertTransport`: one expert server as seen from an attention replica.

Shape legend: N rows grouped by expert, G experts in the request, H hidden.

    fut = transport.forward(layer, x[N, H], expert_ids[G], counts[G], placement_version)
    y = fut.result()            # [N, H] in x.dtype, on x.device
    fut = transport.forward(layer, x[T, H], expert_ids[G], None, placement_version, weights[T, G])
    y = fut.result()            # [T, H]: combined on the server

Implementations: `GrpcTransport` (any host; the tensors ride in the gRPC message) and
`DistTransport` (same node; gRPC opens a torch.distributed link, then each call is one frame each
way on it). `open_transport` picks one per peer. Failures surface as `ExpertServerError`.
"""
from __future__ import annotations

from concurrent.futures import Future, InvalidStateError
from typing import Protocol

import grpc
from torch import Tensor


class PeerInfo(Protocol):
    """What a transport needs to know about an expert server (moemesh.contracts.info.ServerInfo fits)."""

    server_id: str
    address: str
    host_id: str
    dist_addr: str


class ExpertServerError(RuntimeError):
    """An expert server failed a request; names the server, carries the gRPC status when there is one."""

    def __init__(self, server_id: str, address: str, message: str, code: grpc.StatusCode | None = None):
        super().__init__(f"expert server {server_id} ({address}): {message}")
        self.server_id = server_id
        self.address = address
        self.detail = message
        self.code = code


class ExpertTransport(Protocol):
    server_id: str

    def forward(
        self, layer: int, x: Tensor, expert_ids: Tensor, counts: Tensor | None, placement_version: int = 0, weights: Tensor | None = None
    ) -> Future:
        """Future resolving to y [N, H] (x.dtype, x.device), or failing with ExpertServerError.
        With weights [T, G] float32 (and counts None) the server combines: x is [T, H] with each
        token once and y [T, H] = sum_g weights[:, g] * expert_g(x)."""
        ...

    def close(self) -> None: ...


def rpc_error(peer: PeerInfo, e: grpc.RpcError) -> ExpertServerError:
    """A failed call (sync grpc.RpcError or aio AioRpcError: both carry code() and details())."""
    return ExpertServerError(peer.server_id, peer.address, f"{e.code().name}: {e.details()}", e.code())


def settle(fut: Future, value: object = None, error: BaseException | None = None) -> None:
    """Set `fut` once: the first outcome wins; a future already done or cancelled is left as it is."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)
    except InvalidStateError:
        pass
