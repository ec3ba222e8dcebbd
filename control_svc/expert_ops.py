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
        self._channels: dict[str, object] = {}

    def stub(self, address: str):
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = make_channel(address, self.rpc)
        return expert_grpc.ExpertServiceStub(ch)

    async def load(self, server: ServerInfo, experts: dict[int, tuple[int, ...]], version: int) -> None:
        req = expert_pb2.LoadExpertsRequest(placement_version=version, experts=layer_experts_msgs(experts))
        await self.stub(server.address).LoadExperts(req, timeout=self.timeout_s)

    async def drop(self, server: ServerInfo, experts: dict[int, tuple[int, ...]], version: int) -> None:
        req = expert_pb2.DropExpertsRequest(placement_version=version, experts=layer_experts_msgs(experts))
        await self.stub(server.address).DropExperts(req, timeout=self.timeout_s)

    async def ping(self, server: ServerInfo, timeout_s: float) -> None:
        """Raises unless the server answers GetStats within `timeout_s`."""
        await self.stub(server.address).GetStats(expert_pb2.GetStatsRequest(), timeout=timeout_s)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            await ch.close()
