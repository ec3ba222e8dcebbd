"""`GrpcExpertOps`: the control plane calling LoadExperts/DropExperts (and GetStats as a probe) on expert servers."""
from __future__ import annotations

from moemesh.contracts.info import ServerInfo
from moemesh.rpc.config import RpcConfig
from moemesh.rpc.protos import load
from moemesh.rpc.server import make_channel

expert_pb2, expert_grpc = load("expert")


def layer_experts_msgs(experts: dict[int, tuple[int, ...]]):
    return [expert_pb2.LayerExperts(layer=l, expert_ids=list(es)) for l, es in sorted(experts.items())]


class GrpcExpertOps:
    def __init__(self, rpc: RpcConfig, timeout_s: float):
        self.rpc = rpc
        self.timeout_s = timeout_s
        # one channel per registered server (id and address): a server restarted at the same address
        # registers under a new id and gets a fresh channel, not the old one's reconnect backoff
        self._channels: dict[tuple[str, str], object] = {}

    def stub(self, server: ServerInfo):
        key = (server.server_id, server.address)
        ch = self._channels.get(key)
        if ch is None:
            ch = self._channels[key] = make_channel(server.address, self.rpc)
        return expert_grpc.ExpertServiceStub(ch)

    async def forget(self, server_id: str) -> None:
        """Closes the channels of a server that is gone (dead or deregistered)."""
        gone = [k for k in self._channels if k[0] == server_id]
        for k in gone:
            await self._channels.pop(k).close()

    async def load(self, server: ServerInfo, experts: dict[int, tuple[int, ...]], version: int) -> float | None:
        """The seconds the server spent loading, as it reports them (None: not reported)."""
        req = expert_pb2.LoadExpertsRequest(placement_version=version, experts=layer_experts_msgs(experts))
        # wait_for_ready: a server that registered a moment ago may still be bringing its port up
        resp = await self.stub(server).LoadExperts(req, timeout=self.timeout_s, wait_for_ready=True)
        return resp.change_seconds or None

    async def drop(self, server: ServerInfo, experts: dict[int, tuple[int, ...]], version: int) -> None:
        req = expert_pb2.DropExpertsRequest(placement_version=version, experts=layer_experts_msgs(experts))
        await self.stub(server).DropExperts(req, timeout=self.timeout_s)

    async def ping(self, server: ServerInfo, timeout_s: float) -> None:
        """Raises unless the server answers GetStats within `timeout_s`."""
        await self.stub(server).GetStats(expert_pb2.GetStatsRequest(), timeout=timeout_s)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            await ch.close()
