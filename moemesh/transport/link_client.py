"""`LinkClient`: expert calls over one open dist link, from the attention replica's side.

The caller's thread posts the request frame (gloo, without waiting for it to go out; a link with
an NCCL data pair sends from the receiver thread, which keeps its operations in one order), then a
receiver thread per link takes the replies in order and completes each call's future: one message each way per call, no event-loop or pool
hand-off. A failed call answers with its gRPC status and the link goes on; a broken link (peer
gone, timed out, out of step) fails every call on it with UNAVAILABLE (DEADLINE_EXCEEDED when it
timed out) and the owner opens a new one for the next call.
"""
from __future__ import annotations

import datetime
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc
import torch
from torch import Tensor

from moemesh.transport.base import ExpertServerError, PeerInfo, settle
from moemesh.transport.dist_frames import CLOSE, CLOSED, ForwardCall, FrameError, parse_reply, request_frame
from moemesh.transport.dist_link import DistLink, LinkBroken
from moemesh.transport.forward_stream import STATUS_BY_VALUE


@dataclass
class _Pending:
    future: Future | None  # None: the CLOSE request
    frame: tuple[list[int], list[Tensor]] | None  # still to send (NCCL), None when already posted
    device: torch.device  # where y goes
    shape: tuple[int, ...] = ()  # y's expected shape: x's
    sends: list = field(default_factory=list)  # the request's posted sends (gloo), awaited with the reply


class LinkClient:
    def __init__(self, link: DistLink, peer: PeerInfo, timeout_s: float, max_bytes: int):
        self.link = link
        self.peer = peer
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.max_bytes = max_bytes
        self.broken: ExpertServerError | None = None
        self._send_lock = threading.Lock()  # one sender at a time; orders the pending queue like the wire
        self._pending: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._receive, name=f"dist-recv-{peer.server_id}", daemon=True)
        self._thread.start()

    @property
    def usable(self) -> bool:
        return self.broken is None and not self._closed

    def submit(self, call: ForwardCall) -> Future:
        """Future of y [R, H] on call.x's device, or failing with ExpertServerError."""
        fut: Future = Future()
        frame = request_frame(call)
        with self._send_lock:
            if not self.usable:
                fut.set_exception(self._failure())
                return fut
            if not self.link.serial:
                try:
                    sends = self.link.post_frame(*frame)
                except LinkBroken as e:
                    self._break_locked(str(e))
                    fut.set_exception(self._failure())
                    return fut
                self._pending.put(_Pending(fut, None, call.x.device, tuple(call.x.shape), sends))
            else:
                self._pending.put(_Pending(fut, frame, call.x.device, tuple(call.x.shape)))
        return fut

    def close(self) -> None:
        """Ask the server to end the link (after the calls already sent) and stop the receiver."""
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
            if self.broken is not None:
                return
            frame = ([CLOSE], [])
            sends = []
            if not self.link.serial:
                try:
                    sends = self.link.post_frame(*frame)
                except LinkBroken:
                    self._pending.put(None)
                    return
                frame = None
            self._pending.put(_Pending(None, frame, torch.device("cpu"), (), sends))

    def _receive(self) -> None:
        if self.link.device.type == "cuda":
            torch.cuda.set_device(self.link.device)  # the current device is per thread
        while True:
            item = self._pending.get()
            if item is None:
                return
            if self.broken is not None:
                self._fail(item)
                continue
            try:
                if item.frame is not None:
                    self.link.send_frame(*item.frame, self.timeout)
                words, payload = self.link.recv_frame(self.max_bytes, self.timeout)
                self.link.wait_sent(item.sends, self.timeout)  # done: the server answered
                if item.future is None:
                    return  # the CLOSE answer: the server has ended the link
                if words[0] == CLOSED:
                    raise LinkBroken(f"link {self.link.link_id}: the server closed the link")
                reply = parse_reply(words, payload)
            except (LinkBroken, FrameError) as e:
                with self._send_lock:
                    self._break_locked(str(e))
                self._fail(item)
                continue
            if isinstance(reply, tuple):
                code = STATUS_BY_VALUE.get(reply[0], grpc.StatusCode.UNKNOWN)
                settle(item.future, error=ExpertServerError(self.peer.server_id, self.peer.address, f"{code.name}: {reply[1]}", code))
            elif tuple(reply.shape) != item.shape:
                settle(item.future, error=ExpertServerError(
                    self.peer.server_id, self.peer.address, f"reply y has shape {list(reply.shape)}, expected {list(item.shape)}",
                ))
            else:  # y may view the link's inbox, which the next reply overwrites: copy it out
                settle(item.future, value=reply.to(item.device, copy=True))

    def _break_locked(self, message: str) -> None:
        """Mark the link broken (under the send lock): every call still queued fails, the receiver ends."""
        if self.broken is None:
            timed_out = "Timed out" in message or "timed out" in message
            code = grpc.StatusCode.DEADLINE_EXCEEDED if timed_out else grpc.StatusCode.UNAVAILABLE
            self.broken = ExpertServerError(self.peer.server_id, self.peer.address, f"{code.name}: dist {message}", code)
            self._pending.put(None)

    def _fail(self, item: _Pending) -> None:
        if item.future is not None:
            settle(item.future, error=self._failure())

    def _failure(self) -> ExpertServerError:
        """A fresh exception per caller (one instance is never raised in many places at once)."""
        b = self.broken or ExpertServerError(self.peer.server_id, self.peer.address, "CANCELLED: transport closed", grpc.StatusCode.CANCELLED)
        return ExpertServerError(b.server_id, b.address, b.detail, b.code)
