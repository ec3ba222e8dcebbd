"""`AttentionControlClient`: an attention replica's side of the control plane.

    client = AttentionControlClient(control_addr, rpc)
    replica_id = await client.register(my_address)
    placement, servers = await client.wait_placement(timeout_s=60)
    remote = RemoteExperts(placement, servers, transport_for)
    task = asyncio.create_task(client.follow(remote.set_placement, lambda: remote.adopted_version))
    ...
    task.cancel(); await client.close()

`follow` applies every committed placement (WatchPlacement) and heartbeats the version the replica
runs on, which is what lets the control plane release old expert copies.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import grpc

from control_svc.placement.types import Placement
from control_svc.wire import ServerInfo, control_grpc, control_pb2, placement_from_proto, server_from_proto
from moemesh.rpc.config import RpcConfig
from moemesh.rpc.server import make_channel

log = logging.getLogger(__name__)


def view_of(update) -> tuple[Placement, dict[str, ServerInfo]]:
    servers = {s.server_id: s for s in map(server_from_proto, update.servers)}
    return placement_from_proto(update.placement), servers


class AttentionControlClient:
    def __init__(self, control_addr: str, rpc: RpcConfig):
        self.channel = make_channel(control_addr, rpc)
        self.stub = control_grpc.ControlServiceStub(self.channel)
        self.replica_id = ""
        self.address = ""
        self.interval_s = 1.0

    async def register(self, address: str, timeout_s: float = 30.0) -> str:
        resp = await self.stub.RegisterAttentionReplica(
            control_pb2.RegisterAttentionReplicaRequest(address=address), timeout=timeout_s, wait_for_ready=True
        )
        self.replica_id = resp.replica_id
        self.address = address
        self.interval_s = resp.heartbeat_interval_s or self.interval_s
        return self.replica_id

    async def wait_placement(self, timeout_s: float) -> tuple[Placement, dict[str, ServerInfo]]:
        """The committed placement, waiting until the control plane has placed the experts."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            update = await self.stub.GetPlacement(control_pb2.GetPlacementRequest(), timeout=timeout_s, wait_for_ready=True)
            if update.placement.version > 0:
                return view_of(update)
            if loop.time() > deadline:
                raise TimeoutError(f"the control plane placed no experts within {timeout_s}s (are the expert servers up?)")
            await asyncio.sleep(0.1)

    async def follow(self, apply: Callable[[Placement, dict[str, ServerInfo]], None], adopted: Callable[[], int]) -> None:
        """Until cancelled: apply each new placement, heartbeat `adopted()`; reconnects on errors."""
        beats = asyncio.create_task(self._heartbeats(adopted))
        try:
            after = 0
            while True:
                try:
                    stream = self.stub.WatchPlacement(control_pb2.WatchPlacementRequest(replica_id=self.replica_id, after_version=after))
                    async for update in stream:
                        placement, servers = view_of(update)
                        apply(placement, servers)
                        after = placement.version
                except grpc.aio.AioRpcError as e:
                    log.warning("placement watch broke (%s); reconnecting", e.details())
                    await asyncio.sleep(self.interval_s)
        finally:
            beats.cancel()

    async def _heartbeats(self, adopted: Callable[[], int]) -> None:
        while True:
            try:
                resp = await self.stub.Heartbeat(control_pb2.HeartbeatRequest(id=self.replica_id, adopted_version=adopted()), timeout=5)
                if not resp.known:
                    log.warning("the control plane forgot replica %s: registering again", self.replica_id)
                    await self.register(self.address)
            except grpc.aio.AioRpcError as e:
                log.warning("heartbeat failed: %s", e.details())
            await asyncio.sleep(self.interval_s)

    async def close(self) -> None:
        await self.channel.close()
