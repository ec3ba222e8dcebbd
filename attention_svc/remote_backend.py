"""`RemoteBackend`: experts on the mesh's expert servers, following the control plane.

    open:  register this replica's address later; watch placements; wait for the first one (v >= 1)
    run:   every new placement is staged on `RemoteExperts` and adopted at the next step boundary,
           together with the routing knobs (top-k, capacity) its version carries, applied to the
           engine for all MoE layers at once (`apply_knobs`); heartbeats report the adopted version
           so the control plane can release old copies; a layer whose expert server died is
           reported to the control plane and retried on the placement without it (`FailoverExperts`)
    close: stop watching, close the transports
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import Callable

import grpc

from attention_svc.config import AttentionConfig
from attention_svc.experts import ExpertBackend
from attention_svc.failover_experts import FailoverExperts
from attention_svc.remote_experts import RemoteExperts
from moemesh.contracts.knobs import MoeKnobs
from moemesh.contracts.wire import control_grpc, control_pb2, knobs_from_proto, placement_from_proto, server_from_proto
from moemesh.rpc.server import make_channel
from moemesh.transport.dist_transport import open_transport

log = logging.getLogger(__name__)

FIRST_PLACEMENT_TIMEOUT_S = 300.0


def decode_update(msg):
    """PlacementUpdate -> (Placement, {server id: ServerInfo})."""
    return placement_from_proto(msg.placement), {s.server_id: server_from_proto(s) for s in msg.servers}


def engine_knob_setter(engine) -> Callable[[MoeKnobs], None]:
    """apply(knobs): every MoE layer of `engine` set to its effective top-k and capacity factor."""
    cfg = engine.model_config

    def apply(knobs: MoeKnobs) -> None:
        for layer in cfg.moe_layers:
            top_k, cf = knobs.effective(layer, cfg.top_k)
            engine.set_moe_knobs(top_k=top_k, capacity_factor=cf, layer=layer)

    return apply


class RemoteBackend(ExpertBackend):
    def __init__(self, cfg: AttentionConfig) -> None:
        self.cfg = cfg
        self.channel = make_channel(cfg.control_addr, cfg.rpc)
        self.stub = control_grpc.ControlServiceStub(self.channel)
        self.compute: FailoverExperts | None = None
        self.replica_id = ""
        self.on_placement = lambda: None  # set by the server: wakes the step loop to adopt it
        self.apply_knobs: Callable[[MoeKnobs], None] | None = None  # set by the server (engine_knob_setter)
        self._knobs: dict[int, MoeKnobs] = {}  # placement version -> knobs it carries
        self._applied_knobs = MoeKnobs()  # what the engine runs with (its own defaults)
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    async def open(self) -> None:
        """Waits for the control plane's first placement and builds `RemoteExperts` on it."""
        updates = self.stub.WatchPlacement(control_pb2.WatchPlacementRequest(after_version=0), wait_for_ready=True)
        try:
            first = await asyncio.wait_for(self._first_placement(updates), FIRST_PLACEMENT_TIMEOUT_S)
        except asyncio.TimeoutError:
            updates.cancel()
            raise RuntimeError(f"control_addr: no expert placement from {self.cfg.control_addr} within {FIRST_PLACEMENT_TIMEOUT_S:.0f}s")
        transport_for = functools.partial(open_transport, mode=self.cfg.transport, rpc=self.cfg.rpc)
        self._loop = asyncio.get_running_loop()
        self.compute = FailoverExperts(RemoteExperts(*first, transport_for=transport_for), self._report_failure, self.cfg.failover_timeout_s)
        self._tasks.append(asyncio.create_task(self._follow(updates)))

    async def _first_placement(self, updates):
        async for msg in updates:
            placement, servers = decode_update(msg)
            if placement.version >= 1:
                self._knobs[placement.version] = knobs_from_proto(msg.knobs)
                return placement, servers
        raise RuntimeError(f"control_addr: {self.cfg.control_addr} closed the placement stream before placing any expert")

    async def _follow(self, updates) -> None:
        try:
            async for msg in updates:
                placement, servers = decode_update(msg)
                self._knobs[placement.version] = knobs_from_proto(msg.knobs)
                self.compute.set_placement(placement, servers)
                self.on_placement()
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                log.error("placement stream from the control plane ended: %s", e.details())

    def placement_version(self) -> int:
        return self.compute.placement.version if self.compute else 0

    def begin_step(self) -> None:
        """Between engine steps: adopt a staged placement and the knobs its version carries."""
        if self.compute is None:
            return
        version = self.compute.begin_step()
        knobs = self._knobs.get(version)
        for old in [v for v in self._knobs if v < version]:
            del self._knobs[old]
        if knobs is not None and knobs != self._applied_knobs and self.apply_knobs is not None:
            self.apply_knobs(knobs)
            self._applied_knobs = knobs
            log.info("placement v%d: MoE knobs %s", version, knobs.describe())

    def _report_failure(self, server_id: str, detail: str) -> None:
        """From a failover thread: ReportFailure on the control plane (waits at most a few seconds)."""
        req = control_pb2.ReportFailureRequest(reporter_id=self.replica_id, server_id=server_id, detail=detail[:500])

        async def report():  # the aio call must be created on the backend's loop
            return await self.stub.ReportFailure(req, timeout=5)

        asyncio.run_coroutine_threadsafe(report(), self._loop).result(6)

    async def register(self, address: str) -> None:
        resp = await self.stub.RegisterAttentionReplica(control_pb2.RegisterAttentionReplicaRequest(address=address), timeout=30)
        self.replica_id = resp.replica_id
        self._tasks.append(asyncio.create_task(self._heartbeat(address, resp.heartbeat_interval_s or 1.0)))

    async def _heartbeat(self, address: str, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            req = control_pb2.HeartbeatRequest(id=self.replica_id, adopted_version=self.compute.adopted_version)
            try:
                resp = await self.stub.Heartbeat(req, timeout=5)
                if not resp.known:
                    reg = await self.stub.RegisterAttentionReplica(
                        control_pb2.RegisterAttentionReplicaRequest(address=address), timeout=5)
                    self.replica_id = reg.replica_id
            except grpc.aio.AioRpcError as e:
                log.warning("heartbeat to the control plane failed: %s", e.details())

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self.compute is not None:
            await asyncio.to_thread(self.compute.close)  # closing dist links waits on their peers
        await self.channel.close()


async def open_remote_experts(cfg: AttentionConfig) -> RemoteBackend:
    backend = RemoteBackend(cfg)
    try:
        await backend.open()
    except BaseException:
        await backend.close()
        raise
    return backend
