"""Pair process groups for the torch.distributed transport, formed on demand from a TCPStore.

An expert server hosts a `TCPStore` (its "dist endpoint") and is rank 0 of one 2-process group per
client ("link"); the client is rank 1. Groups are built directly (`ProcessGroupGloo` for CPU tensors,
`ProcessGroupNCCL` for CUDA) under a `PrefixStore` named by the link id, never through
`init_process_group`, so servers and clients come and go without restarting anything.
Tensors travel as flat byte views with paired send/recv; shapes and dtypes travel over gRPC.
gloo matches send/recv by tag, so requests may be in flight concurrently; NCCL has no tags, so a
link serialises its requests (one lock held for the send and the matching receive).
"""
from __future__ import annotations

import datetime
import socket
import threading
from pathlib import Path

import torch
import torch.distributed as dist

GLOO = "gloo"
NCCL = "nccl"
MAX_TAG = 1 << 30


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


class DistLink:
    """One pair group as seen from one side: send/recv tensors by tag with the peer rank."""

    def __init__(self, link_id: str, group: dist.ProcessGroup, rank: int, backend: str, device: torch.device):
        self.link_id = link_id
        self.group = group
        self.peer = 1 - rank
        self.backend = backend
        self.device = device
        self.serial = threading.Lock() if backend == NCCL else None
        self._tag_lock = threading.Lock()
        self._next_tag = 0

    def new_tag(self) -> int:
        with self._tag_lock:
            self._next_tag = (self._next_tag + 1) % MAX_TAG
            return self._next_tag

    def send(self, t: torch.Tensor, tag: int) -> None:
        if t.numel() == 0:
            return
        flat = t.to(self.device).contiguous().reshape(-1).view(torch.uint8)
        self.group.send([flat], self.peer, tag).wait()

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, tag: int) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if nbytes:
            self.group.recv([buf], self.peer, tag).wait()
        return buf.view(dtype).reshape(shape)
