"""`GrpcTransport`: Forward calls to one expert server with the tensors inside the gRPC message.

The calls travel over one long-lived `ForwardStream` per server (reopened after a failure) on a
sync channel; the stub (`stub()`) also serves `DistTransport`'s `OpenDistLink`.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future

import grpc
from torch import Tensor

from moemesh.rpc.config import RpcConfig
from moemesh.rpc.protos import load
from moemesh.rpc.server import make_sync_channel
from moemesh.transport.base import ExpertServerError, PeerInfo
from moemesh.transport.codec import CodecError, decode, encode
from moemesh.transport.forward_stream import ForwardStream

expert_pb2, expert_grpc = load("expert")


class GrpcTransport:
    def __init__(self, peer: PeerInfo, rpc: RpcConfig, timeout_s: float = 60.0):
        self.peer = peer
        self.server_id = peer.server_id
        self.rpc = rpc
        self.timeout_s = timeout_s
        self._channel: grpc.Channel | None = None
        self._stub = None
        self._stream: ForwardStream | None = None
        self._lock = threading.Lock()

    def stub(self):
        """The sync stub, its channel opened on first use."""
        with self._lock:
            if self._stub is None:
                if not self.peer.address or ":" not in self.peer.address:
                    raise ValueError(f"address must be host:port, got {self.peer.address!r}")
                self._channel = make_sync_channel(self.peer.address, self.rpc)
                self._stub = expert_grpc.ExpertServiceStub(self._channel)
            return self._stub

    def forward(
        self, layer: int, x: Tensor, expert_ids: Tensor, counts: Tensor | None, placement_version: int = 0, weights: Tensor | None = None
    ) -> Future:
        """x [N, H], expert_ids [G], counts [G] -> Future of y [N, H]; with weights [T, G] (counts
        None) x is [T, H] and y the server-combined [T, H] (see ExpertTransport)."""
        req = expert_pb2.ForwardRequest(
            layer=layer, placement_version=placement_version, expert_ids=expert_ids.tolist(),
            counts=[] if counts is None else counts.tolist(),
        )
        encode(x, out=req.x)
        if weights is not None:
            encode(weights, out=req.weights)

        def on_reply(resp) -> Tensor:
            try:
                y = decode(resp.y, field="y", max_bytes=self.rpc.max_message_bytes, ndim=2)
            except CodecError as e:
                raise ExpertServerError(self.server_id, self.peer.address, f"bad reply: {e}") from None
            if y.shape != x.shape:
                raise ExpertServerError(self.server_id, self.peer.address, f"reply y has shape {list(y.shape)}, expected {list(x.shape)}")
            return y.to(x.device)

        return self.stream().call(req, on_reply)

    def stream(self) -> ForwardStream:
        """This server's stream, opened (or reopened after a failure) as needed."""
        stub = self.stub()
        with self._lock:
            if self._stream is None or self._stream.broken is not None:
                self._stream = ForwardStream(stub, self.peer, self.timeout_s)
            return self._stream

    def close(self) -> None:
        with self._lock:
            stream, channel = self._stream, self._channel
            self._stream = self._channel = self._stub = None
        if stream is not None:
            stream.close()
        if channel is not None:
            channel.close()
