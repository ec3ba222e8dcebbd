"""Pair process groups for the torch.distributed transport, formed on demand from a TCPStore.

An expert server hosts a `TCPStore` (its "dist endpoint") and is rank 0 of one link per client;
the client is rank 1. A link is a gloo pair group (the control pair: every frame's header, and for
CPU servers the whole frame) and, for CUDA servers, an NCCL pair group for the payloads (the data
pair). Groups are built directly (`ProcessGroupGloo`, `ProcessGroupNCCL`) under a `PrefixStore`
named by the link id, never through `init_process_group`, so servers and clients come and go
without restarting anything. Calls travel as frames (`dist_frames`) on the link, in order: gRPC
only opens it.

Anyone who reaches the TCPStore can list its keys and join a pair group, so a link is used only
after both ranks proved they know the link's secret (handed to the client over the authenticated
`OpenDistLink` RPC, never put in the store): the client sends HMAC(secret, "client" + link id),
the server checks it and answers HMAC(secret, "server" + link id), which the client checks before
sending a single call. An outsider who joins first only breaks that link (the client opens another).

Why headers never go over NCCL: a link waits for its next call as long as it is idle, and an NCCL
receive left pending past the group's timeout makes NCCL's watchdog tear the process down. A gloo
receive may wait without limit, and an NCCL payload operation is posted only once its header has
arrived (its peer posts the matching one right after the header), so no NCCL operation ever idles.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
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


def open_link(store: dist.Store, link_id: str, rank: int, backend: str, host: str, device: torch.device, timeout_s: float,
              secret: bytes) -> "DistLink":
    """Both pairs of a link (blocks until the peer joins them too), after the secret handshake
    (LinkBroken when the peer does not know `secret`). backend: "gloo" (one gloo pair) or "nccl"
    (a gloo control pair and an NCCL data pair)."""
    control = pair_group(store, link_id, rank, GLOO, host, timeout_s)
    link = DistLink(link_id, control, rank, torch.device("cpu"))
    prove_secret(link, secret, rank, datetime.timedelta(seconds=timeout_s))
    data = pair_group(store, f"{link_id}/data", rank, NCCL, host, timeout_s) if backend == NCCL else None
    return DistLink(link_id, control, rank, device, data)


HELLO = 3  # the handshake frame's kind (after dist_frames' FORWARD and CLOSE)


def _proof(secret: bytes, role: str, link_id: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(hmac.new(secret, f"{role}|{link_id}".encode(), hashlib.sha256).digest()), dtype=torch.uint8)


def prove_secret(link: "DistLink", secret: bytes, rank: int, timeout: datetime.timedelta) -> None:
    """The client (rank 1) proves it knows the link's secret, then the server (rank 0) does."""
    if len(secret) < 16:
        raise LinkBroken(f"link {link.link_id}: no link secret (at least 16 bytes)")
    mine, theirs = ("client", "server") if rank == 1 else ("server", "client")
    if rank == 1:
        link.send_frame([HELLO], [_proof(secret, mine, link.link_id)], timeout)
    words, payload = link.recv_frame(64, timeout)
    expected = _proof(secret, theirs, link.link_id)
    if words[0] != HELLO or not hmac.compare_digest(bytes(payload.tolist()), bytes(expected.tolist())):
        raise LinkBroken(f"link {link.link_id}: the peer does not know the link's secret")
    if rank == 0:
        link.send_frame([HELLO], [_proof(secret, mine, link.link_id)], timeout)


class LinkBroken(RuntimeError):
    """The pair group failed (peer gone, timed out, or out of step): the link cannot be used again."""


class DistLink:
    """One link as seen from one side: frames (dist_frames) to and from the peer rank.

    Control pair only (gloo): a frame of up to `INLINE_BYTES` travels as one message into the
    receiver's reusable inbox (a gloo receive may be longer than what arrives); a bigger one as its
    header, then the payload. With a data pair: the header on the control pair, the payload (exact
    size, on the link's device) on the data pair. One thread sends and one receives at a time (the
    caller's locks); with a data pair (`serial`) every operation goes through one thread in order,
    as NCCL needs the two sides to issue their operations in the same order.
    """

    def __init__(self, link_id: str, control: dist.ProcessGroup, rank: int, device: torch.device, data: dist.ProcessGroup | None = None):
        self.link_id = link_id
        self.control = control
        self.data = data
        self.peer = 1 - rank
        self.device = device
        self.serial = data is not None
        self._inbox = torch.empty(INLINE_BYTES, dtype=torch.uint8)

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
        inline = self.data is None and HEADER_BYTES + n <= INLINE_BYTES
        frame = torch.empty(HEADER_BYTES + (n if inline else 0), dtype=torch.uint8)
        frame[:HEADER_BYTES] = header.view(torch.uint8)
        if inline:
            start = HEADER_BYTES
            for f in flat:
                frame[start:start + f.numel()] = f
                start += f.numel()
            return [self._post_send(self.control, frame)]
        works = [self._post_send(self.control, frame)]
        if n:
            pair, where = (self.control, torch.device("cpu")) if self.data is None else (self.data, self.device)
            works.append(self._post_send(pair, torch.cat([f.to(where) for f in flat])))
        return works

    def wait_sent(self, works: list, timeout: datetime.timedelta) -> None:
        for work in works:
            try:
                work.wait(timeout)
            except RuntimeError as e:
                raise LinkBroken(f"link {self.link_id}: send failed: {e}") from None

    def recv_frame(self, max_bytes: int, timeout: datetime.timedelta) -> tuple[list[int], torch.Tensor]:
        """(words, payload uint8 [nbytes]): with a data pair the payload is on the link's device;
        without, on the CPU, and an inline one views the inbox (use it before the next recv_frame).
        Raises LinkBroken when the frame exceeds max_bytes."""
        self._recv(self.control, self._inbox, timeout)
        words = self._inbox[:HEADER_BYTES].view(torch.int64).tolist()
        n = words[-1]
        if self.data is None and 0 <= n and HEADER_BYTES + n <= INLINE_BYTES:
            return words, self._inbox[HEADER_BYTES:HEADER_BYTES + n]
        if not 0 <= n <= max_bytes:
            raise LinkBroken(f"link {self.link_id}: a frame of {n} bytes exceeds the limit of {max_bytes} bytes")
        pair, where = (self.control, torch.device("cpu")) if self.data is None else (self.data, self.device)
        payload = torch.empty(n, dtype=torch.uint8, device=where)
        if n:
            self._recv(pair, payload, timeout)
        return words, payload

    def _post_send(self, pair: dist.ProcessGroup, t: torch.Tensor):
        try:
            return pair.send([t], self.peer, FRAME_TAG)
        except RuntimeError as e:
            raise LinkBroken(f"link {self.link_id}: send failed: {e}") from None

    def _recv(self, pair: dist.ProcessGroup, t: torch.Tensor, timeout: datetime.timedelta) -> None:
        try:
            pair.recv([t], self.peer, FRAME_TAG).wait(timeout)
        except RuntimeError as e:
            raise LinkBroken(f"link {self.link_id}: receive failed: {e}") from None
