"""`DistTransport`: expert calls over a torch.distributed pair group with a same-node server.

gRPC opens the link once (`OpenDistLink` names a link id and the server's TCPStore; both sides then
build the link's pair groups, the client as rank 1); every call after that is one request frame and one
reply frame on the link (`dist_frames`, sent and received by `LinkClient`), with no gRPC message
per call. A broken link is replaced by a new one on the next call.
"""
from __future__ import annotations

import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import torch
from torch import Tensor

from moemesh.rpc.config import RpcConfig
from moemesh.transport.base import ExpertServerError, PeerInfo, rpc_error, settle
from moemesh.transport.dist_frames import ForwardCall
from moemesh.transport.dist_link import DistLink, LinkBroken, connect_store, host_id, open_link, split_addr
from moemesh.transport.grpc_transport import GrpcTransport, expert_pb2
from moemesh.transport.link_client import LinkClient


class DistTransport:
    def __init__(self, peer: PeerInfo, rpc: RpcConfig, client_id: str | None = None, timeout_s: float = 60.0):
        if not peer.dist_addr:
            raise ValueError(f"expert server {peer.server_id} ({peer.address}) offers no dist endpoint (dist_addr is empty)")
        self.peer = peer
        self.server_id = peer.server_id
        self.rpc = rpc
        self.rpc_transport = GrpcTransport(peer, rpc, timeout_s)
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:8]}"
        self.timeout_s = timeout_s
        self._client: LinkClient | None = None
        self._lock = threading.Lock()
        self._store = None
        self._closed = False
        self._opener = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"dist-open-{peer.server_id}")

    def forward(
        self, layer: int, x: Tensor, expert_ids: Tensor, counts: Tensor | None, placement_version: int = 0, weights: Tensor | None = None
    ) -> Future:
        """x [N, H], expert_ids [G], counts [G] -> Future of y [N, H]; with weights [T, G] (counts
        None) x and y are [T, H] (see ExpertTransport)."""
        call = ForwardCall(layer, placement_version, expert_ids.tolist(), [] if counts is None else counts.tolist(), x, weights)
        client = self._client
        if client is not None and client.usable:
            return client.submit(call)  # sent from this thread
        out: Future = Future()
        self._opener.submit(self._open_and_submit, call, out)
        return out

    def _open_and_submit(self, call: ForwardCall, out: Future) -> None:
        try:
            fut = self.link_client().submit(call)
        except ExpertServerError as e:
            settle(out, error=e)
            return
        except Exception as e:  # noqa: BLE001 - e.g. the store unreachable: a server failure to fail over from
            settle(out, error=ExpertServerError(self.server_id, self.peer.address, f"UNAVAILABLE: cannot open the dist link: {e}", grpc.StatusCode.UNAVAILABLE))
            return
        fut.add_done_callback(lambda f: settle(out, error=f.exception()) if f.exception() else settle(out, value=f.result()))

    def link_client(self) -> LinkClient:
        """The open link (opened, or reopened after a break, here: blocking)."""
        with self._lock:
            if self._closed:
                raise ExpertServerError(self.server_id, self.peer.address, "CANCELLED: transport closed", grpc.StatusCode.CANCELLED)
            if self._client is None or not self._client.usable:
                self._client = LinkClient(self._open(), self.peer, self.timeout_s, self.rpc.max_message_bytes)
            return self._client

    def _open(self) -> DistLink:
        req = expert_pb2.OpenDistLinkRequest(client_id=self.client_id, host_id=host_id())
        try:
            resp = self.rpc_transport.stub().OpenDistLink(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise rpc_error(self.peer, e) from None
        device = torch.device("cuda", torch.cuda.current_device()) if resp.backend == "nccl" else torch.device("cpu")
        if self._store is None:
            self._store = connect_store(resp.store_addr, self.timeout_s)
        host, _ = split_addr(resp.store_addr, "store_addr")
        try:
            return open_link(self._store, resp.link_id, resp.client_rank, resp.backend, host, device, self.timeout_s, resp.link_secret)
        except (RuntimeError, ValueError, LinkBroken) as e:
            raise ExpertServerError(self.server_id, self.peer.address, f"UNAVAILABLE: cannot form the dist link: {e}", grpc.StatusCode.UNAVAILABLE) from None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()
        self._opener.shutdown(wait=False, cancel_futures=True)
        self.rpc_transport.close()
        self._store = None


def open_transport(peer: PeerInfo, mode: str, rpc: RpcConfig, client_id: str | None = None, timeout_s: float = 60.0):
    """mode "grpc" | "dist" | "auto" (dist when the peer is on this node, offers a dist endpoint and
    its device is reachable from here: NCCL for a CUDA server needs CUDA in this process)."""
    if mode == "grpc":
        return GrpcTransport(peer, rpc, timeout_s)
    if mode == "dist":
        if peer.host_id != host_id():
            raise ValueError(f"transport dist: expert server {peer.server_id} ({peer.address}) is on another node")
        return DistTransport(peer, rpc, client_id, timeout_s)
    if mode == "auto":
        if peer.dist_addr and peer.host_id == host_id() and can_reach_device(getattr(peer, "device", "cpu")):
            return DistTransport(peer, rpc, client_id, timeout_s)
        return GrpcTransport(peer, rpc, timeout_s)
    raise ValueError(f"transport must be grpc, dist or auto, got {mode!r}")


def can_reach_device(device: str) -> bool:
    """A CUDA expert server pairs over NCCL, which needs CUDA on this side too; CPU ones use gloo."""
    return not device.startswith("cuda") or torch.cuda.is_available()
