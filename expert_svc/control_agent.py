"""`ControlAgent`: an expert server's conversation with the control plane.

Register (address, device, memory, slot budget, host id, dist endpoint) -> server id; heartbeat at
the interval the control plane asks for; on drain, tell it and deregister. The control plane drives
placement by calling LoadExperts/DropExperts on the server.

When the control plane forgets the server (it restarted, or declared the server dead: a heartbeat
answers `known=false`), the agent registers again with the id it had, the experts it holds and the
newest placement version it has heard of, so a restarted control plane can rebuild its placement
from what the servers hold; then `on_registered` gets the placement the answer carries. A failed
heartbeat or registration is logged and tried again at the next interval: the loop never ends on
its own.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from typing import Awaitable, Callable

import grpc

from moemesh.contracts.info import ServerInfo
from moemesh.contracts.placement import LayerExperts, Placement
from moemesh.contracts.wire import control_grpc, control_pb2, held_to_proto, placement_from_proto, server_to_proto
from moemesh.errors import MeshError
from moemesh.rpc.config import RpcConfig
from moemesh.rpc.server import make_channel

log = logging.getLogger(__name__)


class ControlAgent:
    def __init__(self, control_addr: str, rpc: RpcConfig, info: ServerInfo, stats: Callable[[], object],
                 held: Callable[[], LayerExperts] = dict):
        """stats() -> moemesh.v1.ExpertStats sent with each heartbeat; held() -> the experts the
        server holds, reported when it registers."""
        self.info = info
        self.stats = stats
        self.held = held
        self.channel = make_channel(control_addr, rpc)
        self.stub = control_grpc.ControlServiceStub(self.channel)
        self.server_id = ""
        self.instance = uuid.uuid4().hex  # this process: a restarted control plane's ids may repeat
        self.placement_version = 0  # the newest placement version heard of
        self.interval_s = 1.0

    async def register(self, timeout_s: float = 30.0) -> Placement:
        """Register (again: with the id, experts and placement version this server has), retrying
        while the control plane is not up yet; returns the current placement."""
        request = control_pb2.RegisterExpertServerRequest(
            server=server_to_proto(dataclasses.replace(self.info, server_id=self.server_id)), held=held_to_proto(self.held()),
            placement_version=self.placement_version, instance=self.instance,
        )
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            try:
                resp = await self.stub.RegisterExpertServer(request, timeout=5, wait_for_ready=True)
                break
            except grpc.aio.AioRpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"control plane did not answer RegisterExpertServer within {timeout_s}s: {e.details()}") from e
        self.server_id = resp.server_id
        self.interval_s = resp.heartbeat_interval_s or self.interval_s
        placement = placement_from_proto(resp.placement)
        self.placement_version = max(self.placement_version, placement.version)
        return placement

    def heard_of(self, version: int) -> None:
        """Placement `version` exists (e.g. a LoadExperts for it arrived): reported when registering again."""
        self.placement_version = max(self.placement_version, version)

    def _heartbeat_request(self):
        return control_pb2.HeartbeatRequest(id=self.server_id, stats=self.stats(), instance=self.instance)

    async def heartbeat_forever(self, on_registered: Callable[[Placement], Awaitable[None]] | None = None) -> None:
        """Heartbeat every interval; when the control plane does not know this server, register again
        and hand the placement it answers to `on_registered`. Failures are logged, never fatal."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                resp = await self.stub.Heartbeat(self._heartbeat_request(), timeout=5)
                if resp.known:
                    self.placement_version = max(self.placement_version, resp.placement_version)
                    continue
                log.warning("control plane does not know %s any more: registering again (holding experts of placement v%d)",
                            self.server_id, self.placement_version)
                placement = await self.register()
                log.info("registered again as %s; the control plane's placement is v%d", self.server_id, placement.version)
                if on_registered is not None:
                    await on_registered(placement)
            except grpc.aio.AioRpcError as e:
                log.warning("heartbeat to the control plane failed: %s", e.details())
            except Exception:  # noqa: BLE001 - e.g. registering timed out: the next interval tries again
                log.exception("heartbeat or registration with the control plane failed")

    async def check_drop(self, experts: dict[int, list[int]]) -> None:
        """Before a DropExperts: MeshError FAILED_PRECONDITION when the control plane's committed
        placement still gives this server one of `experts` (the control plane itself drops only
        copies its placement no longer names, at release), UNAVAILABLE when it cannot be asked. So
        a DropExperts from anyone else cannot take experts away that requests still need."""
        try:
            resp = await self.stub.GetPlacement(control_pb2.GetPlacementRequest(), timeout=5)
        except grpc.aio.AioRpcError as e:
            raise MeshError(grpc.StatusCode.UNAVAILABLE, f"experts: cannot check the drop with the control plane: {e.details()}") from None
        placement = placement_from_proto(resp.placement)
        placed = placement.experts_on(self.server_id) if self.server_id else {}
        kept = [(layer, e) for layer, es in experts.items() for e in es if e in placed.get(layer, ())]
        if kept:
            named = ", ".join(f"layer {layer} expert {e}" for layer, e in kept[:8])
            raise MeshError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"experts: {named} {'is' if len(kept) == 1 else 'are'} still placed on this server by placement "
                            f"v{placement.version}: only the control plane drops experts, once its placement no longer names them")

    async def drain(self) -> bool:
        """Tell the control plane we are leaving; True when it is moving our experts elsewhere."""
        resp = await self._best_effort(self.stub.Drain, control_pb2.DrainRequest(id=self.server_id))
        return bool(resp is not None and resp.moving)

    async def still_moving(self) -> bool:
        """While draining: is the control plane still moving our experts away? False when it is
        done, gave up, or cannot be reached (then nobody will release us)."""
        resp = await self._best_effort(self.stub.Heartbeat, self._heartbeat_request())
        return bool(resp is not None and resp.moving)

    async def deregister(self) -> None:
        await self._best_effort(self.stub.Deregister, control_pb2.DeregisterRequest(id=self.server_id))

    async def _best_effort(self, method, request):
        try:
            return await method(request, timeout=5)
        except grpc.aio.AioRpcError as e:  # shutting down anyway: report and go on
            log.warning("%s for %s failed: %s", type(request).__name__, self.server_id, e.details())
            return None

    async def close(self) -> None:
        await self.channel.close()
