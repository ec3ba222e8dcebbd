"""`DistHub`: the expert server's side of the torch.distributed transport.

It hosts the TCPStore clients rendezvous on and forms one pair group per client link (the server is
rank 0). Forming a group blocks until the client joins, so it runs on a background thread and the
first request on a link waits for it.
"""
from __future__ import annotations

import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from moemesh.transport.dist_link import DistLink, backend_for, host_id, pair_group, start_store

SERVER_RANK = 0
CLIENT_RANK = 1


class DistHub:
    def __init__(self, host: str, port: int, device: torch.device, timeout_s: float):
        self.host = host
        self.device = device
        self.backend = backend_for(device)
        self.timeout_s = timeout_s
        self.host_id = host_id()
        self.store = start_store(host, port, timeout_s)
        self.addr = f"{host}:{self.store.port}"
        self._links: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dist-link")

    def open(self, client_id: str, client_host_id: str) -> str:
        """Start forming a pair group with `client_id`; returns the link id it must join."""
        if client_host_id != self.host_id:
            raise ValueError(f"host_id {client_host_id!r} is not this server's node ({self.host_id!r}): use the grpc transport")
        link_id = f"{client_id}/{uuid.uuid4().hex[:12]}"
        fut = self._pool.submit(self._form, link_id)
        with self._lock:
            self._links[link_id] = fut
        return link_id

    def _form(self, link_id: str) -> DistLink:
        group = pair_group(self.store, link_id, SERVER_RANK, self.backend, self.host, self.timeout_s)
        return DistLink(link_id, group, SERVER_RANK, self.backend, self.device)

    def link(self, link_id: str) -> DistLink:
        """The formed link (waits for the client to join); KeyError when the id is unknown."""
        with self._lock:
            fut = self._links[link_id]
        return fut.result(self.timeout_s)

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for fut in links:
            fut.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
