"""`DistHub`: the expert server's side of the torch.distributed transport.

It hosts the TCPStore clients rendezvous on and forms one link (dist_link: a gloo pair, plus an
NCCL pair for a CUDA server) per client (the server is rank 0). Each link then has its own thread
that answers the client's frames in order: receive a request, run the handler (the shard's call,
which checks the request), send the reply; a failed call answers with its gRPC status and the link
goes on. The thread ends when the client sends CLOSE or
the link breaks (the client is gone); a process exit ends it too.
"""
from __future__ import annotations

import datetime
import logging
import secrets
import threading
import uuid
from typing import Callable

import grpc
import torch

from moemesh.errors import MeshError
from moemesh.transport.base import ExpertRequest
from moemesh.transport.dist_frames import CLOSE, CLOSED, FORWARD, FrameError, error_reply, ok_reply, parse_request
from moemesh.transport.dist_link import DistLink, LinkBroken, backend_for, host_id, open_link, start_store

SERVER_RANK = 0
CLIENT_RANK = 1
IDLE_WAIT = datetime.timedelta(days=30)  # a link waits this long for its client's next call

log = logging.getLogger(__name__)


Handler = Callable[[ExpertRequest], torch.Tensor]  # y [T, H]; raises MeshError


class DistHub:
    def __init__(self, host: str, port: int, device: torch.device, timeout_s: float, max_bytes: int, handler: Handler):
        """handler: computes one call; max_bytes: the largest request frame a link accepts."""
        self.host = host
        self.device = device
        self.backend = backend_for(device)
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.handler = handler
        self.host_id = host_id()
        self.store = start_store(host, port, timeout_s)
        self.addr = f"{host}:{self.store.port}"
        self._threads: dict[str, threading.Thread] = {}
        self._ending: set[str] = set()  # links whose thread is tearing its group down
        self._lock = threading.Lock()
        self._closed = False

    def open(self, client_id: str, client_host_id: str) -> tuple[str, bytes]:
        """Start forming a pair group with `client_id` and serving it; returns the link id it must
        join and the link's secret (the client proves it knows it before the link serves)."""
        if client_host_id != self.host_id:
            raise ValueError(f"host_id {client_host_id!r} is not this server's node ({self.host_id!r}): use the grpc transport")
        link_id = f"{client_id}/{uuid.uuid4().hex[:12]}"
        secret = secrets.token_bytes(32)
        thread = threading.Thread(target=self._run_link, args=(link_id, secret), name=f"dist-link-{link_id}", daemon=True)
        with self._lock:
            if self._closed:
                raise ValueError("the server is stopping: no new dist links")
            self._threads = {k: t for k, t in self._threads.items() if t.is_alive()}
            self._ending &= set(self._threads)
            self._threads[link_id] = thread
        thread.start()
        return link_id, secret

    @property
    def open_links(self) -> int:
        with self._lock:
            return sum(t.is_alive() for t in self._threads.values())

    def _run_link(self, link_id: str, secret: bytes) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread
        try:
            link = open_link(self.store, link_id, SERVER_RANK, self.backend, self.host, self.device, self.timeout_s, secret)
        except (RuntimeError, LinkBroken) as e:
            log.warning("dist link %s: the client did not join: %s", link_id, e)
            return
        try:
            self._answer(link)
        except LinkBroken as e:
            log.info("dist link %s ended: %s", link_id, e)
        finally:
            with self._lock:
                self._ending.add(link_id)  # `close` waits for this thread: the group is torn down next
            del link  # the pair groups' teardown runs here, not during interpreter exit

    def _answer(self, link: DistLink) -> None:
        timeout = datetime.timedelta(seconds=self.timeout_s)
        while True:
            words, payload = link.recv_frame(self.max_bytes, IDLE_WAIT)
            if words[0] == CLOSE:
                link.send_frame([CLOSED], [], timeout)
                return
            link.send_frame(*self._reply(words, payload), timeout)

    def _reply(self, words: list[int], payload: torch.Tensor) -> tuple[list[int], list[torch.Tensor]]:
        try:
            if words[0] != FORWARD:
                raise FrameError(f"dist frame: kind {words[0]} is not FORWARD ({FORWARD}) or CLOSE ({CLOSE})")
            return ok_reply(self.handler(parse_request(words, payload)))
        except FrameError as e:
            return error_reply(grpc.StatusCode.INVALID_ARGUMENT.value[0], str(e))
        except MeshError as e:
            return error_reply(e.code.value[0], e.message)
        except Exception as e:  # noqa: BLE001 - a handler bug: answer it, keep the link
            log.exception("dist call failed")
            return error_reply(grpc.StatusCode.INTERNAL.value[0], f"{type(e).__name__}: {e}")

    def close(self, join_timeout_s: float = 5.0) -> None:
        """No new links; waits for links that are ending (a gloo group torn down while the process
        exits aborts it). Links still open keep answering until their client closes them or the
        process exits (a thread waiting on its client cannot be interrupted)."""
        with self._lock:
            self._closed = True
            ending = [t for k, t in self._threads.items() if k in self._ending]
        for t in ending:
            t.join(join_timeout_s)
