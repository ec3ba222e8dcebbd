"""An expert server's `ControlAgent` against a fake control plane stub: a heartbeat answered unknown
(the control plane restarted, or declared this server dead) registers the server again with the id,
experts and newest placement version it has (a LoadExperts' version counts); the placement the registration answers then decides its
copies (stale ones dropped, placed ones loaded) except those a LoadExperts for a newer placement
changed meanwhile; the heartbeat loop goes on afterwards."""
import asyncio

from expert_svc.control_agent import ControlAgent
from moemesh.contracts.placement import Placement
from moemesh.contracts.wire import control_pb2, held_from_proto, placement_to_proto
from moemesh.models.registry import load_model_config
from moemesh.rpc.protos import load
from tests.fixtures.expert_servers import running_expert_servers
from tests.fixtures.auth import TEST_RPC

expert_pb2, _ = load("expert")


class FakeControl:
    """Heartbeats: known with placement v3 committed, then unknown once, then known. The registration is
    answered with `placement`; before answering, `meanwhile` runs (what the control plane does while
    the answer travels: the join rebalance's LoadExperts)."""

    def __init__(self, placement: Placement, meanwhile):
        self.placement, self.meanwhile = placement, meanwhile
        self.heartbeats: list = []
        self.registrations: list = []

    async def Heartbeat(self, req, timeout=None):  # noqa: N802 - gRPC method name
        self.heartbeats.append(req)
        return control_pb2.HeartbeatResponse(known=len(self.heartbeats) != 2, placement_version=3)

    async def RegisterExpertServer(self, req, timeout=None, wait_for_ready=False):  # noqa: N802
        self.registrations.append(req)
        await self.meanwhile()
        return control_pb2.RegisterExpertServerResponse(server_id="expert-4", heartbeat_interval_s=0.01,
                                                        placement=placement_to_proto(self.placement))


def test_a_forgotten_server_registers_again_with_what_it_has_and_keeps_what_a_newer_placement_loaded(tiny_model_dir, loop):
    layer = load_model_config(tiny_model_dir).moe_layers[0]
    with running_expert_servers(tiny_model_dir, 1, loop) as (server,):
        shard = server.shard
        for le in list(shard.held()):
            shard.drop(le, range(8))

        async def load_for(version, experts):
            req = expert_pb2.LoadExpertsRequest(placement_version=version, experts=[expert_pb2.LayerExperts(layer=layer, expert_ids=experts)])
            await server.servicer.LoadExperts(req, None)

        async def join_rebalance():  # expert 2 loaded here for placement v8, before the v7 answer is handled
            await load_for(8, [2])

        # placement v7 (answered to the registration): expert 5 on this server's new id, the rest elsewhere
        v7 = Placement(7, {layer: tuple(("expert-4",) if e == 5 else ("expert-0",) for e in range(8))})
        fake = FakeControl(v7, join_rebalance)

        async def run():
            agent = ControlAgent("127.0.0.1:9", TEST_RPC, server.info(), lambda: None, shard.held)
            agent.stub, agent.server_id, agent.interval_s = fake, "expert-1", 0.01
            server.attach(agent)
            # what it held before the control plane forgot it: loaded for v6, whose commit no heartbeat told it of
            await load_for(6, [0, 1, 2, 3])
            beats = asyncio.create_task(agent.heartbeat_forever(server._registered_again))
            try:
                for _ in range(500):
                    if len(fake.heartbeats) >= 5:
                        break
                    await asyncio.sleep(0.01)
            finally:
                beats.cancel()
            await agent.channel.close()
            server.agent = None  # the fake knows no Drain: shut down like a server without a control plane
            return agent

        agent = loop.run(run(), 30)
        assert len(fake.heartbeats) >= 5 and len(fake.registrations) == 1  # the loop went on after registering again
        req = fake.registrations[0]
        assert req.server.server_id == "expert-1" and req.placement_version == 6 and req.instance == agent.instance != ""
        assert held_from_proto(req.held) == {layer: (0, 1, 2, 3)}
        assert {h.instance for h in fake.heartbeats} == {agent.instance}
        assert agent.server_id == "expert-4" and fake.heartbeats[-1].id == "expert-4" and agent.placement_version == 8
        # 0, 1, 3 stale (dropped); 2 loaded for the newer v8 (kept); 5 placed by v7 (loaded)
        assert shard.held() == {layer: (2, 5)}
