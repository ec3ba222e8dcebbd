"""What travels between an attention replica and one expert server, and the transport interface.

Shape legend: T_s tokens the server needs, N_s rows (token-expert pairs) for it, G_s experts named,
H hidden.

    fut = transport.forward(ExpertRequest(layer, version, x[T_s, H], token_idx[N_s], weights[N_s],
                                          expert_ids[G_s], counts[G_s]))
    y = fut.result()            # [T_s, H] in x.dtype, on x.device: this server's weighted partial sum

Implementations: `GrpcTransport` (any host; the tensors ride in `ForwardStream` messages) and
`DistTransport` (same node; gRPC opens a torch.distributed link, then each call is one frame each
way on it). `open_transport` picks one per peer. A failed call fails its future with
`moemesh.errors.MeshError` naming the server (`server_id`, `address`) and carrying the status.
"""
from __future__ import annotations

from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Protocol

import grpc
from torch import Tensor

from moemesh.errors import MeshError


class PeerInfo(Protocol):
    """What a transport needs to know about an expert server (moemesh.contracts.info.ServerInfo fits)."""

    server_id: str
    address: str
    host_id: str
    dist_addr: str


@dataclass(frozen=True)
class ExpertRequest:
    """One expert server's part of one MoE layer call: each token it needs once, and per row (grouped
    by expert) the token it reads and the weight its output carries. The server returns
    y [T_s, H] (x.dtype): y[t] = sum over rows r with token_idx[r] == t of weights[r] * expert(r)(x[t]).

    layer              decoder layer index
    placement_version  the placement the caller split the layer by
    x           [T_s, H] float32 / bfloat16 / float16
    token_idx   [N_s] int32  row -> index into x
    weights     [N_s] float32 combine weight of each row
    expert_ids  [G_s] int64  logical experts, each once; rows grouped in this order
    counts      [G_s] int64  rows per expert (sum N_s)
    """

    layer: int
    placement_version: int
    x: Tensor
    token_idx: Tensor
    weights: Tensor
    expert_ids: Tensor
    counts: Tensor


class ExpertTransport(Protocol):
    server_id: str

    def forward(self, req: ExpertRequest) -> Future:
        """Future resolving to y [T_s, H] (req.x.dtype, on req.x.device), or failing with MeshError."""
        ...

    def close(self) -> None: ...


def peer_error(peer: PeerInfo, code: grpc.StatusCode, message: str) -> MeshError:
    """A failed call to `peer`."""
    return MeshError(code, message, server_id=peer.server_id, address=peer.address)


def settle(fut: Future, value: object = None, error: BaseException | None = None) -> None:
    """Set `fut` once: the first outcome wins; a future already done or cancelled is left as it is."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)
    except InvalidStateError:
        pass
