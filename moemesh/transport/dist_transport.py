"""`DistTransport`: one same-node expert server's calls as frames on a torch.distributed pair group.

gRPC opens the link once (`OpenDistLink` names a link id and the server's TCPStore; both sides then
build the link's pair groups, the client as rank 1); every call after that is one request frame and
one reply frame on the link (`dist_frames`), with no gRPC message per call.

The caller's thread posts the request frame (gloo, without waiting for it to go out; a link with an
NCCL data pair sends from the receiver thread, which keeps its operations in one order), then a
receiver thread per link takes the replies in order and completes each call's future: one message
each way per call, no event-loop or pool hand-off. A failed call answers with its gRPC status and the
link goes on; a broken link (peer gone, timed out, out of step) fails every call on it with
UNAVAILABLE (DEADLINE_EXCEEDED when it timed out), and the next call opens a new link (on a thread
of its own: forming the pair groups blocks).
"""
from __future__ import annotations

import datetime
import queue
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import torch
from torch import Tensor

from moemesh.errors import MeshError, from_rpc_error
from moemesh.rpc.config import RpcConfig
from moemesh.transport.base import ExpertRequest, PeerInfo, peer_error, settle
from moemesh.transport.dist_frames import CLOSE, CLOSED, FrameError, parse_reply, request_frame
from moemesh.transport.dist_link import DistLink, LinkBroken, connect_store, host_id, open_link, split_addr
from moemesh.transport.grpc_transport import STATUS_BY_VALUE, GrpcTransport, expert_pb2


@dataclass
class _Pending:
    """A request on the link, waiting for its reply (future None: the CLOSE request)."""

    future: Future | None
    frame: tuple[list[int], list[Tensor]] | None  # still to send (NCCL), None when already posted
    device: torch.device  # where y goes
    shape: tuple[int, ...] = ()  # y's expected shape: x's
    sends: list = field(default_factory=list)  # the request's posted sends (gloo), awaited with the reply


@dataclass
class _Link:
    """One open link: the pair groups, the requests in flight in wire order (None stops the receiver)."""

    link: DistLink
    pending: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    broken: MeshError | None = None
    closed: bool = False

    @property
    def usable(self) -> bool:
        return self.broken is None and not self.closed


class DistTransport:
    def __init__(self, peer: PeerInfo, rpc: RpcConfig, client_id: str | None = None, timeout_s: float = 60.0):
        if not peer.dist_addr:
            raise ValueError(f"expert server {peer.server_id} ({peer.address}) offers no dist endpoint (dist_addr is empty)")
        self.peer = peer
        self.server_id = peer.server_id
        self.rpc = rpc
        self.control = GrpcTransport(peer, rpc, timeout_s)  # its stub opens links; no call travels on it
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:8]}"
        self.timeout_s = timeout_s
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._link: _Link | None = None
        self._lock = threading.Lock()  # opening a link; closing
        self._send_lock = threading.Lock()  # one sender at a time: orders the pending queue like the wire
        self._store = None
        self._closed = False
        self._opener = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"dist-open-{peer.server_id}")

    def forward(self, req: ExpertRequest) -> Future:
        """Future of y [T_s, H] in req.x.dtype on req.x.device (see `ExpertTransport`)."""
        link = self._link
        if link is not None and link.usable:
            return self._submit(link, req)  # sent from this thread
        out: Future = Future()
        try:
            self._opener.submit(self._open_and_submit, req, out)
        except RuntimeError:  # closed: the opener takes no more work
            out.set_exception(peer_error(self.peer, grpc.StatusCode.CANCELLED, "transport closed"))
        return out

    def _open_and_submit(self, req: ExpertRequest, out: Future) -> None:
        try:
            fut = self._submit(self._usable_link(), req)
        except MeshError as e:
            settle(out, error=e)
            return
        except Exception as e:  # noqa: BLE001 - e.g. the store unreachable: a server failure to fail over from
            settle(out, error=peer_error(self.peer, grpc.StatusCode.UNAVAILABLE, f"cannot open the dist link: {e}"))
            return
        fut.add_done_callback(lambda f: settle(out, error=f.exception()) if f.exception() else settle(out, value=f.result()))

    def _usable_link(self) -> _Link:
        """The open link (opened, or reopened after a break, here: blocking)."""
        with self._lock:
            if self._closed:
                raise peer_error(self.peer, grpc.StatusCode.CANCELLED, "transport closed")
            if self._link is None or not self._link.usable:
                self._link = _Link(self._open())
                threading.Thread(target=self._receive, args=(self._link,), name=f"dist-recv-{self.server_id}", daemon=True).start()
            return self._link

    def _open(self) -> DistLink:
        req = expert_pb2.OpenDistLinkRequest(client_id=self.client_id, host_id=host_id())
        try:
            resp = self.control.stub().OpenDistLink(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise from_rpc_error(e, self.peer.server_id, self.peer.address) from None
        device = torch.device("cuda", torch.cuda.current_device()) if resp.backend == "nccl" else torch.device("cpu")
        if self._store is None:
            self._store = connect_store(resp.store_addr, self.timeout_s)
        host, _ = split_addr(resp.store_addr, "store_addr")
        try:
            return open_link(self._store, resp.link_id, resp.client_rank, resp.backend, host, device, self.timeout_s, resp.link_secret)
        except (RuntimeError, ValueError, LinkBroken) as e:
            raise peer_error(self.peer, grpc.StatusCode.UNAVAILABLE, f"cannot form the dist link: {e}") from None

    def _submit(self, link: _Link, req: ExpertRequest) -> Future:
        fut: Future = Future()
        frame = request_frame(req)
        with self._send_lock:
            if not link.usable:
                fut.set_exception(self._failure(link))
                return fut
            if link.link.serial:
                link.pending.put(_Pending(fut, frame, req.x.device, tuple(req.x.shape)))
                return fut
            try:
                sends = link.link.post_frame(*frame)
            except LinkBroken as e:
                self._break_locked(link, str(e))
                fut.set_exception(self._failure(link))
                return fut
            link.pending.put(_Pending(fut, None, req.x.device, tuple(req.x.shape), sends))
        return fut

    def _receive(self, link: _Link) -> None:
        if link.link.device.type == "cuda":
            torch.cuda.set_device(link.link.device)  # the current device is per thread
        while True:
            item = link.pending.get()
            if item is None:
                return
            if link.broken is not None:
                self._fail(link, item)
                continue
            try:
                if item.frame is not None:
                    link.link.send_frame(*item.frame, self.timeout)
                words, payload = link.link.recv_frame(self.rpc.max_message_bytes, self.timeout)
                link.link.wait_sent(item.sends, self.timeout)  # done: the server answered
                if item.future is None:
                    return  # the CLOSE answer: the server has ended the link
                if words[0] == CLOSED:
                    raise LinkBroken(f"link {link.link.link_id}: the server closed the link")
                reply = parse_reply(words, payload)
            except (LinkBroken, FrameError) as e:
                with self._send_lock:
                    self._break_locked(link, str(e))
                self._fail(link, item)
                continue
            if isinstance(reply, tuple):
                code = STATUS_BY_VALUE.get(reply[0], grpc.StatusCode.UNKNOWN)
                settle(item.future, error=peer_error(self.peer, code, reply[1]))
            elif tuple(reply.shape) != item.shape:
                settle(item.future, error=peer_error(
                    self.peer, grpc.StatusCode.INTERNAL, f"reply y has shape {list(reply.shape)}, expected {list(item.shape)}"))
            else:  # y may view the link's inbox, which the next reply overwrites: copy it out
                settle(item.future, value=reply.to(item.device, copy=True))

    def _break_locked(self, link: _Link, message: str) -> None:
        """Mark `link` broken (under the send lock): every call still queued fails, the receiver ends."""
        if link.broken is None:
            timed_out = "Timed out" in message or "timed out" in message
            code = grpc.StatusCode.DEADLINE_EXCEEDED if timed_out else grpc.StatusCode.UNAVAILABLE
            link.broken = peer_error(self.peer, code, f"dist {message}")
            link.pending.put(None)

    def _fail(self, link: _Link, item: _Pending) -> None:
        if item.future is not None:
            settle(item.future, error=self._failure(link))

    def _failure(self, link: _Link) -> MeshError:
        """A fresh exception per caller (one instance is never raised in many places at once)."""
        b = link.broken or peer_error(self.peer, grpc.StatusCode.CANCELLED, "transport closed")
        return MeshError(b.code, b.message, server_id=b.server_id, address=b.address)

    def _close_link(self, link: _Link) -> None:
        """Ask the server to end the link (after the calls already sent) and stop the receiver."""
        with self._send_lock:
            if link.closed:
                return
            link.closed = True
            if link.broken is not None:
                return
            frame: tuple[list[int], list[Tensor]] | None = ([CLOSE], [])
            sends = []
            if not link.link.serial:
                try:
                    sends = link.link.post_frame(*frame)
                except LinkBroken:
                    link.pending.put(None)
                    return
                frame = None
            link.pending.put(_Pending(None, frame, torch.device("cpu"), (), sends))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            link, self._link = self._link, None
        if link is not None:
            self._close_link(link)
        self._opener.shutdown(wait=False, cancel_futures=True)
        self.control.close()
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
