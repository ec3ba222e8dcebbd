"""Pair process groups for the torch.distributed transport, formed on demand from a TCPStore.

An expert server hosts a `TCPStore` (its "dist endpoint") and is rank 0 of one 2-process group per
client ("link"); the client is rank 1. Groups are built directly (`ProcessGroupGloo` for CPU tensors,
`ProcessGroupNCCL` for CUDA) under a `PrefixStore` named by the link id, never through
`init_process_group`, so servers and clients come and go without restarting anything.
Calls travel as frames (`dist_frames`) on the link, in order: gRPC only opens it.
"""
from __future__ import annotations

import datetime
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from moemesh.transport.dist_frames import HEADER_BYTES, HEADER_WORDS, as_bytes

GLOO = "gloo"
NCCL = "nccl"
FRAME_TAG = 1  # both directions: a pair orders messages per direction
INLINE_BYTES = 1 << 20  # gloo frames up to this size travel as one message


def host_id() -> str:
    """Equal on two processes iff they run on the same node (hostname + kernel boot id)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    suffix = boot.read_text().strip() if boot.is_file() else ""
    return f"{socket.gethostname()}/{suffix}"


def backend_for(device: torch.device) -> str:
    return NCCL if device.type == "cuda" else GLOO


def split_addr(addr: str, field: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{field} must be host:port, got {addr!r}")
    return host, int(port)


def start_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The server's store (master); `store.port` is the bound port when `port` is 0."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))


def connect_store(addr: str, timeout_s: float) -> dist.TCPStore:
    host, port = split_addr(addr, "dist_addr")
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def pair_group(store: dist.Store, link_id: str, rank: int, backend: str, host: str, timeout_s: float) -> dist.ProcessGroup:
    """Blocks until both ranks of link `link_id` have joined."""
    prefixed = dist.PrefixStore(f"moemesh/link/{link_id}", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == GLOO:
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        opts._timeout = timeout
        return dist.ProcessGroupGloo(prefixed, rank, 2, opts)
    if backend == NCCL:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
    raise ValueError(f"backend must be {GLOO!r} or {NCCL!r}, got {backend!r}")


class LinkBroken(RuntimeError):
    """The pair group failed (peer gone, timed out, or out of step): the link cannot be used again."""


class DistLink:
    """One pair group as seen from one side: frames (dist_frames) to and from the peer rank.

    gloo: a frame of up to `INLINE_BYTES` travels as one message into the receiver's reusable
    inbox (a receive may be longer than what arrives); a bigger one as its header, then the payload.
    NCCL: header and payload always as two messages of exact size, on the link's device. One thread
    sends and one receives at a time (the caller's locks); send and receive may overlap on gloo.
    """

    def __init__(self, link_id: str, group: dist.ProcessGroup, rank: int, backend: str, device: torch.device):
        self.link_id = link_id
        self.group = group
        self.peer = 1 - rank
        self.backend = backend
        self.device = device
        self._inbox = torch.empty(INLINE_BYTES, dtype=torch.uint8) if backend == GLOO else None

    def send_frame(self, words: list[int], parts: list[torch.Tensor], timeout: datetime.timedelta) -> None:
        """words (at most HEADER_WORDS - 1), then the payload parts' bytes back to back; returns once sent."""
        self.wait_sent(self.post_frame(words, parts), timeout)

    def post_frame(self, words: list[int], parts: list[torch.Tensor]) -> list:
        """Starts sending a frame and returns at once: the pending sends, for `wait_sent` (they hold
        their buffers). A gloo send completes only once the peer has posted its receive; waiting for
        it on the side that then receives the reply lets a dead peer surface there at once."""
        flat = [as_bytes(p) for p in parts]
        n = sum(f.numel() for f in flat)
        header = torch.zeros(HEADER_WORDS, dtype=torch.int64)
        header[: len(words)] = torch.tensor(words, dtype=torch.int64)
        header[-1] = n
        inline = self._inbox is not None and HEADER_BYTES + n <= INLINE_BYTES
        frame = torch.empty(HEADER_BYTES + (n if inline else 0), dtype=torch.uint8)
        frame[:HEADER_BYTES] = header.view(torch.uint8)
        if inline:
            start = HEADER_BYTES
            for f in flat:
                frame[start:start + f.numel()] = f
                start += f.numel()
            return [self._post_send(frame)]
        works = [self._post_send(frame.to(self.device))]
        if n:
            works.append(self._post_send(torch.cat([f.to(self.device) for f in flat])))
        return works

    def wait_sent(self, works: list, timeout: datetime.timedelta) -> None:
        for work in works:
            try:
                work.wait(timeout)
            except RuntimeError as e:
                raise LinkBroken(f"link {self.link_id}: send failed: {e}") from None

    def recv_frame(self, max_bytes: int, timeout: datetime.timedelta) -> tuple[list[int], torch.Tensor]:
        """(words, payload uint8 [nbytes] on the link's device). A gloo payload may view the inbox:
        use it before the next recv_frame. Raises LinkBroken when the frame exceeds max_bytes."""
        if self._inbox is not None:
            self._recv(self._inbox, timeout)
            header = self._inbox[:HEADER_BYTES]
        else:
            header = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.device)
            self._recv(header, timeout)
        words = header.cpu().view(torch.int64).tolist()
        n = words[-1]
        if self._inbox is not None and 0 <= n and HEADER_BYTES + n <= INLINE_BYTES:
            return words, self._inbox[HEADER_BYTES:HEADER_BYTES + n]
        if not 0 <= n <= max_bytes:
            raise LinkBroken(f"link {self.link_id}: a frame of {n} bytes exceeds the limit of {max_bytes} bytes")
        payload = torch.empty(n, dtype=torch.uint8, device=self.device)
        if n:
            self._recv(payload, timeout)
        return words, payload

    def _post_send(self, t: torch.Tensor):
        try:
            return self.group.send([t], self.peer, FRAME_TAG)
        except RuntimeError as e:
            raise LinkBroken(f"link {self.link_id}: send failed: {e}") from None

    def _recv(self, t: torch.Tensor, timeout: datetime.timedelta) -> None:
        try:
            self.group.recv([t], self.peer, FRAME_TAG).wait(timeout)
        except RuntimeError as e:
            raise LinkBroken(f"link {self.link_id}: receive failed: {e}") from None
