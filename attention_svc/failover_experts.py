"""`FailoverExperts`: `RemoteExperts` that survive an expert server dying mid-step.

Shape legend: N rows grouped by expert, G experts in the call, H hidden.

When a layer's call fails because an expert server could not be reached, the replica reports it to
the control plane (which probes the server and, if it is gone, switches in a placement without
it), waits for a placement that no longer names that server, adopts it at once (the old one lost a
server, so waiting for the step boundary would only fail again) and submits the same layer again.
Everything is bounded by `timeout_s` per layer call: past it the call fails with the server's
error, the engine step fails and its requests end with UNAVAILABLE, never a hang. A placement-only
change keeps the experts' weights, so a retried layer computes the same outputs.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Mapping

import grpc
from torch import Tensor

from attention_svc.remote_experts import RemoteExperts
from moemesh.contracts.placement import Placement
from moemesh.transport.base import ExpertServerError, PeerInfo, settle

log = logging.getLogger(__name__)

# errors that say "this request was wrong", not "this server is gone": never retried
NOT_RETRIED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)


class FailoverExperts:
    def __init__(self, inner: RemoteExperts, report: Callable[[str, str], None], timeout_s: float) -> None:
        """report(server_id, detail): tell the control plane (must not block long)."""
        self.inner = inner
        self.report = report
        self.timeout_s = timeout_s
        self._changed = threading.Condition()
        self._latest = inner.placement
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="expert-failover")
        self.retries = 0

    # ---- RemoteExperts' placement API, passed through ---------------------------------------
    @property
    def placement(self) -> Placement:
        return self.inner.placement

    @property
    def adopted_version(self) -> int:
        return self.inner.adopted_version

    def set_placement(self, placement: Placement, servers: Mapping[str, PeerInfo]) -> None:
        self.inner.set_placement(placement, servers)
        with self._changed:
            if placement.version > self._latest.version:
                self._latest = placement
            self._changed.notify_all()

    def begin_step(self) -> int:
        return self.inner.begin_step()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.inner.close()

    # ---- ExpertCompute -----------------------------------------------------------------------
    def submit(self, layer: int, x: Tensor, expert_ids: Tensor, counts: Tensor) -> Future:
        """x [N, H]; expert_ids [G]; counts [G] -> Future of [N, H], retried over failovers."""
        return self._retried(layer, lambda: self.inner.submit(layer, x, expert_ids, counts))

    def submit_all(self, layer: int, x: Tensor, weights: Tensor) -> Future:
        """x [T, H]; weights [T, E] -> Future of the combined [T, H], retried over failovers."""
        return self._retried(layer, lambda: self.inner.submit_all(layer, x, weights))

    def _retried(self, layer: int, call: Callable[[], Future]) -> Future:
        out: Future = Future()
        self._attempt(layer, call, out, time.monotonic() + self.timeout_s)
        return out

    def _attempt(self, layer: int, call: Callable[[], Future], out: Future, deadline: float) -> None:
        version = self.inner.placement.version
        try:
            fut = call()
        except Exception as e:  # noqa: BLE001 - e.g. the adopted placement lacks this layer
            settle(out, error=e)
            return
        fut.add_done_callback(lambda f: self._done(f, version, layer, call, out, deadline))

    def _done(self, fut: Future, version: int, layer: int, call: Callable[[], Future], out: Future, deadline: float) -> None:
        err = fut.exception()
        if err is None:
            settle(out, value=fut.result())
        elif not isinstance(err, ExpertServerError) or err.code in NOT_RETRIED or time.monotonic() >= deadline:
            settle(out, error=err)
        else:  # wait for the new placement off the transport's thread
            self._pool.submit(self._retry, err, version, layer, call, out, deadline)

    def _retry(self, err: ExpertServerError, version: int, layer: int, call: Callable[[], Future], out: Future, deadline: float) -> None:
        log.warning("layer %d on placement v%d failed (%s): waiting for a placement without %s", layer, version, err, err.server_id)
        try:
            self.report(err.server_id, str(err))
        except Exception as e:  # noqa: BLE001 - the heartbeat timeout still finds the server
            log.warning("could not report %s to the control plane: %s", err.server_id, e)
        with self._changed:
            ok = self._changed.wait_for(
                lambda: self._latest.version > version and err.server_id not in self._latest.servers(),
                timeout=max(0.0, deadline - time.monotonic()),
            )
        if not ok:
            settle(out, error=ExpertServerError(
                err.server_id, err.address,
                f"no placement without this server within {self.timeout_s:.0f}s after: {err}", grpc.StatusCode.UNAVAILABLE,
            ))
            return
        self.inner.begin_step()
        self.retries += 1
        self._attempt(layer, call, out, deadline)
