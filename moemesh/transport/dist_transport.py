"""`DistTransport`: tensors over a torch.distributed pair group, ids and shapes over gRPC.

The first request opens the link: `OpenDistLink` over gRPC names a link id and the server's
TCPStore; both sides then build the pair group (the client is rank 1). Each request sends x with a
fresh tag, the gRPC `Forward` carries (layer, ids, counts, link id, tag, dtype, shape), and y comes
back on the same tag.
"""
from __future__ import annotations

import asyncio
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import torch
from torch import Tensor

from moemesh.rpc.config import RpcConfig
from moemesh.rpc.loop_thread import LoopThread
from moemesh.transport.base import ExpertServerError, PeerInfo, rpc_error
from moemesh.transport.codec import dtype_name, encode
from moemesh.transport.dist_link import DistLink, connect_store, host_id, pair_group, split_addr
from moemesh.transport.grpc_transport import GrpcTransport, expert_pb2


class DistTransport:
    def __init__(self, peer: PeerInfo, rpc: RpcConfig, loop: LoopThread, client_id: str | None = None, timeout_s: float = 60.0):
        if not peer.dist_addr:
            raise ValueError(f"expert server {peer.server_id} ({peer.address}) offers no dist endpoint (dist_addr is empty)")
        self.peer = peer
        self.server_id = peer.server_id
        self.rpc_transport = GrpcTransport(peer, rpc, loop, timeout_s)
        self.loop = loop
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:8]}"
        self.timeout_s = timeout_s
        self._link: DistLink | None = None
        self._link_lock = threading.Lock()
        self._store = None
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"dist-{peer.server_id}")

    def forward(
        self, layer: int, x: Tensor, expert_ids: Tensor, counts: Tensor | None, placement_version: int = 0, weights: Tensor | None = None
    ) -> Future:
        """x [N, H], expert_ids [G], counts [G] -> Future of y [N, H]; with weights [T, G] (counts
        None; they ride in the gRPC message) x and y are [T, H] (see ExpertTransport)."""
        ids, cnts = expert_ids.tolist(), [] if counts is None else counts.tolist()
        return self.loop.submit(self._call(layer, x, ids, cnts, placement_version, weights))

    async def _call(self, layer: int, x: Tensor, ids: list[int], counts: list[int], version: int, weights: Tensor | None = None) -> Tensor:
        loop = asyncio.get_running_loop()
        link = await loop.run_in_executor(self._pool, self.link)
        tag = link.new_tag()
        req = expert_pb2.ForwardRequest(
            layer=layer,
            placement_version=version,
            expert_ids=ids,
            counts=counts,
            dist=expert_pb2.DistPayload(link_id=link.link_id, tag=tag, dtype=dtype_name(x.dtype), shape=list(x.shape)),
        )
        if weights is not None:
            encode(weights, out=req.weights)
        exchange = loop.run_in_executor(self._pool, self._exchange, link, x, tag)
        try:
            await self.rpc_transport.stub().Forward(req, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            exchange.cancel()
            self._broken(link)
            raise rpc_error(self.peer, e) from None
        y = await exchange
        return y.to(x.device)

    def _exchange(self, link: DistLink, x: Tensor, tag: int) -> Tensor:
        """send x, receive y on `tag` (one at a time per link for NCCL)."""
        if link.serial is not None:
            with link.serial:
                link.send(x, tag)
                return link.recv(tuple(x.shape), x.dtype, tag)
        link.send(x, tag)
        return link.recv(tuple(x.shape), x.dtype, tag)

    def link(self) -> DistLink:
        """The pair group with the server, opened on first use (blocking; runs on the pool)."""
        with self._link_lock:
            if self._link is None:
                self._link = self._open()
            return self._link

    def _open(self) -> DistLink:
        req = expert_pb2.OpenDistLinkRequest(client_id=self.client_id, host_id=host_id())
        async def call():  # on the loop thread: the aio channel belongs to it
            return await self.rpc_transport.stub().OpenDistLink(req, timeout=self.timeout_s)

        try:
            resp = self.loop.run(call(), self.timeout_s + 5)
        except grpc.aio.AioRpcError as e:
            raise rpc_error(self.peer, e) from None
        device = torch.device("cuda", torch.cuda.current_device()) if resp.backend == "nccl" else torch.device("cpu")
        if self._store is None:
            self._store = connect_store(resp.store_addr, self.timeout_s)
        host, _ = split_addr(resp.store_addr, "store_addr")
        try:
            group = pair_group(self._store, resp.link_id, resp.client_rank, resp.backend, host, self.timeout_s)
        except RuntimeError as e:
            raise ExpertServerError(self.server_id, self.peer.address, f"cannot form the dist pair group: {e}") from None
        return DistLink(resp.link_id, group, resp.client_rank, resp.backend, device)

    def _broken(self, link: DistLink) -> None:
        """After a failed request the tags in flight are unknown: the next request opens a new link."""
        with self._link_lock:
            if self._link is link:
                self._link = None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.rpc_transport.close()
        self._link = None
        self._store = None


def open_transport(peer: PeerInfo, mode: str, rpc: RpcConfig, loop: LoopThread, client_id: str | None = None, timeout_s: float = 60.0):
    """mode "grpc" | "dist" | "auto" (dist when the peer is on this node, offers a dist endpoint and
    its device is reachable from here: NCCL for a CUDA server needs CUDA in this process)."""
    if mode == "grpc":
        return GrpcTransport(peer, rpc, loop, timeout_s)
    if mode == "dist":
        if peer.host_id != host_id():
            raise ValueError(f"transport dist: expert server {peer.server_id} ({peer.address}) is on another node")
        return DistTransport(peer, rpc, loop, client_id, timeout_s)
    if mode == "auto":
        if peer.dist_addr and peer.host_id == host_id() and can_reach_device(getattr(peer, "device", "cpu")):
            return DistTransport(peer, rpc, loop, client_id, timeout_s)
        return GrpcTransport(peer, rpc, loop, timeout_s)
    raise ValueError(f"transport must be grpc, dist or auto, got {mode!r}")


def can_reach_device(device: str) -> bool:
    """A CUDA expert server pairs over NCCL, which needs CUDA on this side too; CPU ones use gloo."""
    return not device.startswith("cuda") or torch.cuda.is_available()
