"""`RemoteExperts`: the attention replica's `ExpertCompute`, computing experts on expert servers.

Shape legend: N rows grouped by expert, G experts in the call, H hidden; per server s: N_s rows,
G_s experts.

For one MoE layer it splits each expert's rows evenly over that expert's replicas in the current
`Placement`, sends one request per expert server (all concurrently, through each server's
`ExpertTransport`), and reassembles the outputs in input order.
`submit_all` (every token to every expert) instead sends each server the step's tokens once with
the gate weights of its experts; the server combines, and the partial sums are added here in server
order (deterministic). Each expert is computed by one of its copies, rotating with the step.

Placement changes: `set_placement(p, servers)` stages version N+1; it is adopted by `begin_step()`
(the step loop calls it between engine steps) or, automatically, when a new forward pass starts
(a MoE layer index lower than the previous call's), never in the middle of a step.
`adopted_version` is the version the replica can report to the control plane: the oldest version a
request still in flight uses, so old copies are released only after those requests finished.
A failed call raises `ExpertServerError` naming the server; the caller may stage a new placement,
call `begin_step()` and submit the same layer again.
"""
from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import Tensor

from moemesh.contracts.placement import Placement
from moemesh.moe.expert_compute import completed
from moemesh.transport.base import ExpertTransport, PeerInfo, settle


@dataclass(frozen=True)
class ServerRequest:
    """What one expert server gets for one layer: rows `index` of x, grouped by `expert_ids`."""

    server_id: str
    index: Tensor  # [N_s] int64 row indices into the caller's x, grouped by expert
    expert_ids: Tensor  # [G_s] int64 logical ids
    counts: Tensor  # [G_s] int64


def plan_requests(placement: Placement, layer: int, expert_ids: Tensor, counts: Tensor) -> list[ServerRequest]:
    """Split each expert's contiguous rows into near-equal chunks over its replicas; one request per
    server. The first replica of each chunking rotates with the expert id, so single rows spread."""
    replicas = placement.replicas.get(layer)
    if replicas is None:
        raise KeyError(f"placement v{placement.version} has no layer {layer}")
    per_server: dict[str, tuple[list[Tensor], list[int], list[int]]] = {}
    start = 0
    for e, n in zip(expert_ids.tolist(), counts.tolist()):
        if not 0 <= e < len(replicas):
            raise ValueError(f"expert_ids: expert {e} is outside placement v{placement.version} layer {layer} ({len(replicas)} experts)")
        copies = replicas[e]
        r = len(copies)
        base, extra = divmod(n, r)
        offset = start
        for k in range(r):
            take = base + (1 if k < extra else 0)
            if take == 0:
                continue
            server = copies[(e + k) % r]
            rows, ids, cnts = per_server.setdefault(server, ([], [], []))
            rows.append(torch.arange(offset, offset + take))
            ids.append(e)
            cnts.append(take)
            offset += take
        start += n
    return [
        ServerRequest(s, torch.cat(rows), torch.tensor(ids, dtype=torch.int64), torch.tensor(cnts, dtype=torch.int64))
        for s, (rows, ids, cnts) in sorted(per_server.items())
    ]


class RemoteExperts:
    def __init__(self, placement: Placement, servers: Mapping[str, PeerInfo], transport_for: Callable[[PeerInfo], ExpertTransport]):
        """servers: id -> PeerInfo of (at least) every server the placement names;
        transport_for(peer) opens a transport (e.g. functools.partial(open_transport, mode=..., ...))."""
        self.transport_for = transport_for
        self._lock = threading.Lock()
        self._transports: dict[str, tuple[PeerInfo, ExpertTransport]] = {}
        self._in_flight: Counter[int] = Counter()  # placement version -> calls in flight
        self._staged: tuple[Placement, dict[str, PeerInfo]] | None = None
        self._retired: list[tuple[int, ExpertTransport]] = []  # (version that retired it, transport)
        self._last_layer = -1
        self._rotation = 0  # which copy of a replicated expert submit_all uses, advanced per call
        self.placement = Placement(version=0)
        self._install(placement, dict(servers))

    # ---- placement ---------------------------------------------------------------------------
    def set_placement(self, placement: Placement, servers: Mapping[str, PeerInfo]) -> None:
        """Stage `placement`; adopted at the next step boundary."""
        missing = sorted(set(placement.servers()) - set(servers))
        if missing:
            raise ValueError(f"servers: placement v{placement.version} names servers without an address: {missing}")
        with self._lock:
            if placement.version <= max(self.placement.version, self._staged[0].version if self._staged else 0):
                return  # an old or repeated version: nothing to do
            self._staged = (placement, dict(servers))

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
        missing = sorted(set(placement.servers()) - set(servers))
        if missing:
            raise ValueError(f"servers: placement v{placement.version} names servers without an address: {missing}")
        opened: dict[str, tuple[PeerInfo, ExpertTransport]] = {}
        for sid in placement.servers():
            have = self._transports.get(sid)
            if have is not None and have[0].address == servers[sid].address:
                opened[sid] = have
            else:
                opened[sid] = (servers[sid], self.transport_for(servers[sid]))
        kept = {id(t) for _, t in opened.values()}
        with self._lock:
            for _, t in self._transports.values():
                if id(t) not in kept:  # closed once no call of an older version is in flight
                    self._retired.append((placement.version, t))
            self._transports = opened
            self.placement = placement
        self._close_retired()

    def _close_retired(self) -> None:
        adopted = self.adopted_version
        with self._lock:
            done = [t for v, t in self._retired if v <= adopted]
            self._retired = [(v, t) for v, t in self._retired if v > adopted]
        for t in done:
            t.close()

    # ---- ExpertCompute -----------------------------------------------------------------------
    def submit(self, layer: int, x: Tensor, expert_ids: Tensor, counts: Tensor) -> Future:
        """x [N, H] rows grouped by expert; expert_ids [G]; counts [G] -> Future of [N, H]."""
        self._step_boundary(layer)
        if x.dim() != 2 or expert_ids.shape != counts.shape or int(counts.sum()) != x.shape[0]:
            raise ValueError(
                f"submit: x {list(x.shape)} must be [N, H] with counts summing to N; "
                f"expert_ids {list(expert_ids.shape)} and counts {list(counts.shape)} (sum {int(counts.sum())}) must match"
            )
        if x.shape[0] == 0:
            return completed(torch.empty_like(x))
        placement, transports = self._snapshot()
        requests = {r.server_id: r for r in plan_requests(placement, layer, expert_ids.cpu(), counts.cpu())}
        out = torch.empty_like(x)  # [N, H]

        def send(sid: str) -> Future:
            req = requests[sid]
            xs = x.index_select(0, req.index.to(x.device))  # [N_s, H]
            return transports[sid].forward(layer, xs, req.expert_ids, req.counts, placement.version)

        def place(sid: str, y: Tensor) -> None:  # y [N_s, H]
            # the callback runs on the transport's thread; an output allocated under the engine's
            # inference mode may only be written in inference mode
            with torch.inference_mode(out.is_inference()):
                out.index_copy_(0, requests[sid].index.to(out.device), y)

        return self._fan_out(placement.version, sorted(requests), send, place, lambda: out)

    def submit_all(self, layer: int, x: Tensor, weights: Tensor) -> Future:
        """x [T, H], weights [T, E] float32 combine weights -> Future of [T, H] = sum_e weights[:, e] *
        expert_e(x) in x.dtype, combined on the expert servers."""
        self._step_boundary(layer)
        if x.dim() != 2 or weights.dim() != 2 or weights.shape[0] != x.shape[0]:
            raise ValueError(f"submit_all: x {list(x.shape)} must be [T, H] and weights {list(weights.shape)} [T, E]")
        if x.shape[0] == 0:
            return completed(torch.empty_like(x))
        placement, transports = self._snapshot()
        replicas = placement.replicas.get(layer)
        if replicas is None:
            raise KeyError(f"placement v{placement.version} has no layer {layer}")
        if len(replicas) != weights.shape[1]:
            raise ValueError(f"submit_all: weights has {weights.shape[1]} experts, placement v{placement.version} layer {layer} has {len(replicas)}")
        with self._lock:
            self._rotation += 1
            rotation = self._rotation
        per_server: dict[str, list[int]] = {}
        for e, copies in enumerate(replicas):
            per_server.setdefault(copies[(e + rotation) % len(copies)], []).append(e)
        w = weights.float().cpu()  # [T, E]
        partials: dict[str, Tensor] = {}

        def send(sid: str) -> Future:
            ids = torch.tensor(per_server[sid], dtype=torch.int64)  # [G_s]
            return transports[sid].forward(layer, x, ids, None, placement.version, weights=w[:, ids].contiguous())

        def place(sid: str, y: Tensor) -> None:  # y [T, H], this server's weighted sum
            with self._lock:
                partials[sid] = y

        def total() -> Tensor:
            acc = torch.zeros(x.shape, dtype=torch.float32)  # [T, H]
            for sid in sorted(partials):  # fixed order: the same sum whichever server answers first
                acc += partials[sid].float().cpu()
            return acc.to(x.device, x.dtype)

        return self._fan_out(placement.version, sorted(per_server), send, place, total)

    def _step_boundary(self, layer: int) -> None:
        if layer < self._last_layer:
            self.begin_step()  # a new forward pass: a step boundary
        self._last_layer = layer

    def _snapshot(self) -> tuple[Placement, dict[str, ExpertTransport]]:
        with self._lock:
            placement = self.placement
            transports = {sid: t for sid, (_, t) in self._transports.items()}
        if placement.version == 0:
            raise RuntimeError("no placement yet: the control plane has not placed the experts")
        return placement, transports

    def _fan_out(
        self, version: int, servers: list[str], send: Callable[[str], Future], place: Callable[[str, Tensor], None],
        finish: Callable[[], Tensor],
    ) -> Future:
        """send(server) to every server at once; place(server, y) each answer; the result is finish()
        once all answered, or the first error. Counts the call as in flight on placement `version`."""
        result: Future = Future()
        pending = [len(servers)]
        self._enter(version)

        def done(sid: str, fut: Future) -> None:
            try:
                y = fut.result()
                if not result.done():
                    place(sid, y)
            except BaseException as e:  # noqa: BLE001 - forwarded to the caller's future
                settle(result, error=e)
            with self._lock:
                pending[0] -= 1
                last = pending[0] == 0
            if last:
                self._leave(version)
                if not result.done():
                    try:
                        settle(result, value=finish())
                    except BaseException as e:  # noqa: BLE001
                        settle(result, error=e)

        for sid in servers:
            try:
                fut = send(sid)
            except Exception as e:  # noqa: BLE001 - e.g. encoding failed: report like a failed call
                fut = Future()
                fut.set_exception(e)
            fut.add_done_callback(lambda f, sid=sid: done(sid, f))
        return result

    def _enter(self, version: int) -> None:
        with self._lock:
            self._in_flight[version] += 1

    def _leave(self, version: int) -> None:
        with self._lock:
            self._in_flight[version] -= 1

    def close(self) -> None:
        with self._lock:
            transports = [t for _, t in self._transports.values()] + [t for _, t in self._retired]
            self._transports, self._retired = {}, []
        for t in transports:
            t.close()
