"""`RemoteExperts`: the attention replica's `ExpertCompute`, computing experts on expert servers.

Shape legend: T tokens, N rows (kept token-expert pairs) grouped by expert, G experts with rows,
H hidden; per server s: T_s tokens it needs, N_s rows, G_s experts.

`submit(layer, x, plan)` splits the plan's rows by the current `Placement` (`expert_split`), sends
each expert server the tokens it needs once with, per row, the token's index and the row's combine
weight (`ExpertRequest`, through that server's transport, all servers at once), and adds the servers'
weighted partial sums into [T, H] in a fixed server order, in float32 (`partial_sum`): the result
does not depend on which server answers first. A token whose kept experts share a server crosses the
wire once each way.

Placement changes: `set_placement(p, servers)` stages version N+1; it is adopted by `begin_step()`
(the step loop calls it between engine steps) or, automatically, when a new forward pass starts
(a MoE layer index lower than the previous call's), never in the middle of a step.
`adopted_version` is the version the replica can report to the control plane: the oldest version a
call still in flight uses, so old copies are released only after those calls finished.

Failover: when a call fails because an expert server could not be reached (a `MeshError` naming the
server, with a status other than INVALID_ARGUMENT or RESOURCE_EXHAUSTED), the server is reported
(`report_failure`, e.g. to the control plane, which probes it and, if it is gone, switches in a
placement without it); the layer waits for a placement that no longer names that server, adopts it at
once (the old one lost a server, so waiting for the step boundary would only fail again) and is
computed again. All of it is bounded by `failover_timeout_s` per layer call (0: no failover): past it
the call fails with UNAVAILABLE naming the server, never a hang. A placement-only change keeps the
experts' weights, so a retried layer computes the same outputs (up to the float32 rounding of a
different grouping of the partial sums).

A server that hangs instead of failing (stopped, or cut off without a reset) answers nothing until
the transport's timeout. So when the control plane declares a server dead (`servers_dead`: the news
comes at once, with the placement in force, and again with the placement that drops the server) or a
placement without a server is adopted, the calls still waiting on that server fail at once with
UNAVAILABLE naming it and take the failover path above, and its transport is closed; until a newer
placement names that id again, calls to it fail at once too.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import grpc
import torch
from torch import Tensor

from attention_svc.expert_split import LayerCopies, ServerPart, partial_sum, split_plan
from moemesh.contracts.placement import Placement
from moemesh.errors import MeshError
from moemesh.moe.dispatch import DispatchPlan
from moemesh.transport.base import ExpertRequest, ExpertTransport, PeerInfo, settle

log = logging.getLogger(__name__)

# errors that say "this request was wrong", not "this server is gone": never retried
NOT_RETRIED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)


@dataclass
class _LayerCall:
    """One `submit`: what to compute, where the result goes, until when a failover may retry it."""

    layer: int
    x: Tensor  # [T, H]
    plan: DispatchPlan
    out: Future
    deadline: float


@dataclass
class _Attempt:
    """One try of a layer call on one placement: the servers' answers as they arrive."""

    call: _LayerCall
    version: int
    parts: list[ServerPart]
    pending: int
    partials: dict[str, Tensor] = field(default_factory=dict)  # server -> y [T_s, H]
    failed: bool = False


class RemoteExperts:
    def __init__(
        self, placement: Placement, servers: Mapping[str, PeerInfo], transport_for: Callable[[PeerInfo], ExpertTransport],
        report_failure: Callable[[str, str], None] | None = None, failover_timeout_s: float = 0.0,
    ):
        """servers: id -> PeerInfo of (at least) every server the placement names;
        transport_for(peer) opens a transport (e.g. functools.partial(open_transport, mode=..., ...));
        report_failure(server_id, detail): tell the control plane a server could not be reached
        (called from a failover thread; must not block long)."""
        self.transport_for = transport_for
        self.report_failure = report_failure
        self.failover_timeout_s = failover_timeout_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a placement was staged
        self._transports: dict[str, tuple[PeerInfo, ExpertTransport]] = {}
        self._in_flight: Counter[int] = Counter()  # placement version -> attempts in flight
        self._staged: tuple[Placement, dict[str, PeerInfo]] | None = None
        self._newest = placement  # the newest placement staged or adopted
        self._retired: list[tuple[int, ExpertTransport]] = []  # (version that retired it, transport)
        self._waiting: dict[str, set[Future]] = {}  # server -> its transports' futures not answered yet
        # server declared dead -> (why, the placement version the news came with); until a newer placement names it again
        self._dead: dict[str, tuple[str, int]] = {}
        self._last_layer = -1
        self._rotation = 0  # which copy computes an expert for a plan that sends every token to every expert
        self.placement = Placement(version=0)
        self._layers: dict[int, LayerCopies] = {}
        self._install(placement, dict(servers))

    # ---- placement ---------------------------------------------------------------------------
    def set_placement(self, placement: Placement, servers: Mapping[str, PeerInfo]) -> None:
        """Stage `placement`; adopted at the next step boundary (or by a layer waiting for it)."""
        check_servers(placement, servers)
        with self._lock:
            if placement.version <= self._newest.version:
                return  # an old or repeated version: nothing to do
            self._staged = (placement, dict(servers))
            self._newest = placement
            self._changed.notify_all()

    def begin_step(self) -> int:
        """Adopt a staged placement (call between steps); returns the version now used."""
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is not None:
            self._install(*staged)
        else:
            self._close_retired()
        return self.placement.version

    @property
    def adopted_version(self) -> int:
        """The oldest placement version a call in flight still uses (the current one when idle)."""
        with self._lock:
            live = [v for v, n in self._in_flight.items() if n > 0]
            return min(live + [self.placement.version])

    def _install(self, placement: Placement, servers: dict[str, PeerInfo]) -> None:
        check_servers(placement, servers)
        opened: dict[str, tuple[PeerInfo, ExpertTransport]] = {}
        with self._lock:
            current = dict(self._transports)
            back = {sid for sid, (_, as_of) in self._dead.items() if as_of < placement.version}  # named again by a newer placement
        for sid in placement.servers():
            have = current.get(sid)
            if have is not None and have[0].address == servers[sid].address and sid not in back:
                opened[sid] = have
            else:  # new, moved, or a server of that id came back after being declared dead (its transport is closed)
                opened[sid] = (servers[sid], self.transport_for(servers[sid]))
        kept = {id(t) for _, t in opened.values()}
        layers = {layer: LayerCopies.of(copies) for layer, copies in placement.replicas.items()}
        with self._lock:
            for _, t in self._transports.values():
                if id(t) not in kept:  # closed once no call of an older version is in flight
                    self._retired.append((placement.version, t))
            self._transports = opened
            self.placement, self._layers = placement, layers
            for sid in back & set(placement.servers()):
                del self._dead[sid]
            dropped = [sid for sid in self._waiting if sid not in opened]
        for sid in dropped:  # calls of an older placement to a server this one drops: retried on this one now
            self._fail_waiting(sid, current[sid][0].address if sid in current else "", f"placement v{placement.version} no longer uses this server")
        self._close_retired()

    def servers_dead(self, server_ids: Iterable[str], why: str, as_of_version: int) -> None:
        """The control plane declared these servers dead (news that came with placement
        `as_of_version`, which may still name them: the placement without them can take a while):
        their waiting calls fail now (UNAVAILABLE naming the server, so the layer fails over on the
        placement without them), their transports close, and calls to them fail at once until a newer
        placement names them again."""
        closing = []
        with self._lock:
            named = set(self._newest.servers()) if self._newest.version > as_of_version else set()
            for sid in server_ids:
                if sid in self._dead or sid in named:  # already handled, or (again) a live server of a newer placement
                    continue
                self._dead[sid] = (why, as_of_version)
                have = self._transports.get(sid)
                if have is not None:
                    closing.append((sid, have))
        for sid, (peer, _) in closing:
            log.warning("expert server %s %s: failing its waiting calls over now", sid, why)
            self._fail_waiting(sid, peer.address, why)
        for _, (_, t) in closing:
            t.close()

    def _fail_waiting(self, server_id: str, address: str, why: str) -> None:
        with self._lock:
            waiting = self._waiting.pop(server_id, set())
        for fut in waiting:
            settle(fut, error=MeshError(grpc.StatusCode.UNAVAILABLE, why, server_id=server_id, address=address))

    def _close_retired(self) -> None:
        adopted = self.adopted_version
        with self._lock:
            done = [t for v, t in self._retired if v <= adopted]
            self._retired = [(v, t) for v, t in self._retired if v > adopted]
        for t in done:
            t.close()

    # ---- ExpertCompute -----------------------------------------------------------------------
    def submit(self, layer: int, x: Tensor, plan: DispatchPlan) -> Future:
        """x [T, H] -> Future of [T, H] in x.dtype (see `ExpertCompute`), failing over dead servers."""
        if layer < self._last_layer:
            self.begin_step()  # a new forward pass: a step boundary
        self._last_layer = layer
        out: Future = Future()
        self._attempt(_LayerCall(layer, x, plan, out, time.monotonic() + self.failover_timeout_s))
        return out

    def _attempt(self, call: _LayerCall) -> None:
        """Split the call by the current placement and send every server its part."""
        with self._lock:
            placement, layers = self.placement, self._layers
            transports = {sid: t for sid, (_, t) in self._transports.items()}
            self._rotation += 1
            rotation = self._rotation
        try:
            if placement.version == 0:
                raise RuntimeError("no placement yet: the control plane has not placed the experts")
            layer = layers.get(call.layer)
            if layer is None:
                raise KeyError(f"placement v{placement.version} has no layer {call.layer}")
            parts = split_plan(call.plan, layer, call.x.shape[0], rotation)
        except Exception as e:  # noqa: BLE001 - the caller's future carries it
            settle(call.out, error=e)
            return
        if not parts:  # every row dropped
            settle(call.out, value=torch.zeros_like(call.x))
            return
        attempt = _Attempt(call, placement.version, parts, pending=len(parts))
        with self._lock:
            self._in_flight[placement.version] += 1
        for part in parts:
            sid = part.server_id
            with self._lock:
                dead = self._dead.get(sid)
            try:
                if dead is not None:
                    raise MeshError(grpc.StatusCode.UNAVAILABLE, dead[0], server_id=sid)
                fut = transports[sid].forward(request_for(call, part, placement.version))
            except Exception as e:  # noqa: BLE001 - e.g. encoding failed: reported like a failed call
                fut = Future()
                fut.set_exception(e)
            with self._lock:
                if not fut.done():
                    self._waiting.setdefault(sid, set()).add(fut)
            fut.add_done_callback(lambda f, part=part: self._answered(attempt, part, f))

    def _answered(self, attempt: _Attempt, part: ServerPart, fut: Future) -> None:
        """A server's answer (on its transport's thread): kept, or the attempt fails; the last one sums."""
        err = fut.exception()
        with self._lock:
            self._waiting.get(part.server_id, set()).discard(fut)
            first_failure = err is not None and not attempt.failed
            if err is None:
                attempt.partials[part.server_id] = fut.result()
            else:
                attempt.failed = True
            attempt.pending -= 1
            last = attempt.pending == 0
            if last:
                self._in_flight[attempt.version] -= 1
        if first_failure:
            self._failed(attempt.call, attempt.version, err)
        if last and not attempt.failed:
            try:
                settle(attempt.call.out, value=partial_sum(attempt.call.x, attempt.parts, attempt.partials))
            except Exception as e:  # noqa: BLE001
                settle(attempt.call.out, error=e)

    def _failed(self, call: _LayerCall, version: int, err: BaseException) -> None:
        retried = isinstance(err, MeshError) and err.server_id and err.code not in NOT_RETRIED
        if not retried or time.monotonic() >= call.deadline:
            settle(call.out, error=err)
            return
        threading.Thread(target=self._fail_over, args=(call, version, err), name="expert-failover", daemon=True).start()

    def _fail_over(self, call: _LayerCall, version: int, err: MeshError) -> None:
        """Report the server, wait for a placement without it, adopt it and try the layer again."""
        log.warning("layer %d on placement v%d failed (%r): waiting for a placement without %s", call.layer, version, err, err.server_id)
        with self._lock:
            known = (self._newest.version > version and err.server_id not in self._newest.servers()) or err.server_id in self._dead
        if self.report_failure is not None and not known:  # else the control plane has already moved on
            try:
                self.report_failure(err.server_id, str(err))
            except Exception as e:  # noqa: BLE001 - the heartbeat timeout still finds the server
                log.warning("could not report %s to the control plane: %s", err.server_id, e)
        with self._changed:
            ok = self._changed.wait_for(
                lambda: self._newest.version > version and err.server_id not in self._newest.servers(),
                timeout=max(0.0, call.deadline - time.monotonic()),
            )
        if not ok:
            settle(call.out, error=MeshError(
                grpc.StatusCode.UNAVAILABLE, f"no placement without this server within {self.failover_timeout_s:.0f}s after: {err.message}",
                server_id=err.server_id, address=err.address,
            ))
            return
        self.begin_step()
        self._attempt(call)

    def close(self) -> None:
        with self._lock:
            transports = [t for _, t in self._transports.values()] + [t for _, t in self._retired]
            self._transports, self._retired, self._waiting = {}, [], {}
        for t in transports:
            t.close()


def check_servers(placement: Placement, servers: Mapping[str, PeerInfo]) -> None:
    missing = sorted(set(placement.servers()) - set(servers))
    if missing:
        raise ValueError(f"servers: placement v{placement.version} names servers without an address: {missing}")


def request_for(call: _LayerCall, part: ServerPart, version: int) -> ExpertRequest:
    """A server's part of a layer call as its request: x [T_s, H] holds each of its tokens once."""
    x = call.x if part.tokens is None else call.x.index_select(0, part.tokens.to(call.x.device))
    return ExpertRequest(call.layer, version, x, part.token_idx, part.weights, part.expert_ids, part.counts)
