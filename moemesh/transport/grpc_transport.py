"""`GrpcTransport`: Forward calls to one expert server with the tensors inside the gRPC message.

The calls travel over one long-lived `ForwardStream` per server (reopened after a failure); the
aio stub (`stub()`) also serves `DistTransport`'s control calls.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable

from torch import Tensor

from moemesh.rpc.config import RpcConfig
from moemesh.rpc.loop_thread import LoopThread
from moemesh.rpc.protos import load
from moemesh.rpc.server import make_channel
from moemesh.transport.base import ExpertServerError, PeerInfo
from moemesh.transport.codec import CodecError, decode, encode
from moemesh.transport.forward_stream import ForwardStream

expert_pb2, expert_grpc = load("expert")


class GrpcTransport:
    def __init__(self, peer: PeerInfo, rpc: RpcConfig, loop: LoopThread, timeout_s: float = 60.0):
        self.peer = peer
        self.server_id = peer.server_id
        self.rpc = rpc
        self.loop = loop
        self.timeout_s = timeout_s
        self._channel = None
        self._stub = None
        self._stream: ForwardStream | None = None  # used on the loop thread only

    def stub(self):
        """The aio stub, created on the loop thread on first use (aio channels belong to a loop)."""
        if self._stub is None:
            self._channel = make_channel(self.peer.address, self.rpc)
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
        return self.loop.submit(self._call(req, x))

    async def on_stream(self, req, on_reply: Callable[[Any], Any]) -> Any:
        """Sends a ForwardRequest over this server's stream (opened or reopened as needed); returns
        on_reply(response). On the loop thread; failures raise ExpertServerError."""
        if self._stream is None or self._stream.broken is not None:
            self._stream = ForwardStream(self.stub(), self.peer)
        return await self._stream.call(req, self.timeout_s, on_reply)

    async def _call(self, req, x: Tensor) -> Tensor:
        def on_reply(resp) -> Tensor:
            try:
                y = decode(resp.y, field="y", max_bytes=self.rpc.max_message_bytes, ndim=2)
            except CodecError as e:
                raise ExpertServerError(self.server_id, self.peer.address, f"bad reply: {e}") from None
            if y.shape != x.shape:
                raise ExpertServerError(self.server_id, self.peer.address, f"reply y has shape {list(y.shape)}, expected {list(x.shape)}")
            return y.to(x.device)

        return await self.on_stream(req, on_reply)

    def close(self) -> None:
        if self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            stream, self._stream = self._stream, None

            async def close_all() -> None:
                if stream is not None:
                    stream.close()
                await channel.close()

            try:
                self.loop.run(close_all(), 5)
            except RuntimeError:  # the loop is already gone
                pass
