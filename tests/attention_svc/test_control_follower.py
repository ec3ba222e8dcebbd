"""`ControlFollower` against a fake control plane stub: a placement watch the control plane cancels,
ends or breaks is reopened after the newest version received, with a backoff that doubles while it
keeps failing and starts again once an update arrives; the servers an update names dead are handed
to the experts at once (also when it repeats the version in force: a death notice); a heartbeat answered unknown registers the replica again with the newest
version it received and the knobs that version carries."""
import asyncio
import logging

import grpc
import pytest

from attention_svc import control_follower
from attention_svc.control_follower import ControlFollower
from moemesh.contracts.info import ServerInfo
from moemesh.contracts.knobs import MoeKnobs
from moemesh.contracts.placement import Placement
from moemesh.contracts.wire import control_pb2, knobs_from_proto, knobs_to_proto, placement_to_proto, server_to_proto
from tests.fixtures.auth import TEST_RPC

SERVERS = {"expert-0": ServerInfo("expert-0", "127.0.0.1:1"), "expert-1": ServerInfo("expert-1", "127.0.0.1:2")}


def update(version: int, servers: tuple[str, ...], dead: tuple[str, ...] = (), knobs: MoeKnobs = MoeKnobs()):
    placement = Placement(version, {0: (servers,) * 4})
    return control_pb2.PlacementUpdate(placement=placement_to_proto(placement), servers=[server_to_proto(SERVERS[s]) for s in servers],
                                       knobs=knobs_to_proto(knobs), dead_servers=dead)


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=code.name.lower())


class Watch:
    """One WatchPlacement call: yields `messages`, then raises `end` (None: the stream ends; "hang":
    it stays open)."""

    def __init__(self, messages, end):
        self.messages, self.end = list(messages), end
        self._it = self._run()  # one call: iterating it again goes on where it was

    def __aiter__(self):
        return self._it

    async def _run(self):
        for m in self.messages:
            yield m
        if self.end == "hang":
            await asyncio.Event().wait()
        if self.end is not None:
            raise self.end

    def cancel(self):
        pass


class FakeControl:
    def __init__(self, watches: list[Watch]):
        self.watches = watches
        self.known = True  # False: heartbeats are answered unknown (a restarted control plane)
        self.watch_requests: list = []
        self.registrations: list = []
        self.heartbeats: list = []

    def WatchPlacement(self, req, wait_for_ready=False):  # noqa: N802 - gRPC method name
        self.watch_requests.append(req)
        return self.watches.pop(0) if self.watches else Watch([], "hang")

    async def RegisterAttentionReplica(self, req, timeout=None):  # noqa: N802
        self.registrations.append(req)
        return control_pb2.RegisterAttentionReplicaResponse(replica_id=f"attention-{len(self.registrations) - 1}",
                                                            heartbeat_interval_s=0.01)

    async def Heartbeat(self, req, timeout=None):  # noqa: N802
        self.heartbeats.append(req)
        return control_pb2.HeartbeatResponse(known=self.known)


class FakeExperts:
    adopted_version = 1

    def __init__(self):
        self.staged: list[int] = []
        self.dead: list[tuple[list[str], int]] = []

    def set_placement(self, placement, servers):
        self.staged.append(placement.version)

    def servers_dead(self, server_ids, why, as_of_version):
        self.dead.append((list(server_ids), as_of_version))


async def until(predicate, what, timeout_s=5.0):
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


def test_the_watch_is_reopened_however_it_ends_and_a_forgotten_replica_registers_again(monkeypatch, caplog):
    monkeypatch.setattr(control_follower, "RESUBSCRIBE_BACKOFF_S", 0.01, raising=False)
    knobs = MoeKnobs(top_k=1)
    fake = FakeControl(
        watches=[
            Watch([update(1, ("expert-0", "expert-1"))], rpc_error(grpc.StatusCode.CANCELLED)),  # the control plane shut down
            Watch([], rpc_error(grpc.StatusCode.UNAVAILABLE)),  # not back yet
            Watch([], rpc_error(grpc.StatusCode.UNAVAILABLE)),
            # back: expert-1 declared dead at once (with the placement in force), then the placement without it; the stream ends
            Watch([update(1, ("expert-0", "expert-1"), dead=("expert-1",)), update(5, ("expert-0",), dead=("expert-1",), knobs=knobs)], None),
            Watch([], rpc_error(grpc.StatusCode.UNAVAILABLE)),
        ],
    )

    async def main():
        follower = ControlFollower("127.0.0.1:9", TEST_RPC)
        follower.stub = fake
        experts = FakeExperts()
        placement, _ = await follower.first_placement(5)
        assert placement.version == 1
        with caplog.at_level(logging.WARNING, logger=control_follower.__name__):
            await follower.start(experts, "127.0.0.1:7")
            await until(lambda: len(fake.watch_requests) >= 6, "the watch is reopened after each end")
            fake.known = False  # the restarted control plane does not know this replica
            await until(lambda: len(fake.registrations) >= 2, "the replica registers again")
        await follower.close()
        return experts

    experts = asyncio.run(main())
    assert [r.after_version for r in fake.watch_requests] == [0, 1, 1, 1, 5, 5]
    assert experts.staged == [1, 5] and experts.dead == [(["expert-1"], 1), (["expert-1"], 5)]
    # the backoff doubles while reopening fails and starts again once an update arrived
    waits = [r.args[-1] for r in caplog.records if "placement watch" in r.getMessage()][:5]
    assert waits == pytest.approx([0.01, 0.02, 0.04, 0.01, 0.02])
    first, again = fake.registrations[:2]
    assert (first.placement_version, again.placement_version) == (1, 5)
    assert knobs_from_proto(again.knobs) == knobs and again.instance == first.instance != ""
    assert {h.instance for h in fake.heartbeats} == {first.instance}


def test_a_failed_registration_does_not_end_the_heartbeats():
    """Registering again can fail in ways other than an RPC error (here: the stub raises); the next
    heartbeat tries again, so the replica is not left unknown to the control plane for good."""
    class Flaky(FakeControl):
        async def RegisterAttentionReplica(self, req, timeout=None):  # noqa: N802
            if len(self.registrations) == 1:
                self.registrations.append(None)
                raise RuntimeError("registration failed")
            return await super().RegisterAttentionReplica(req, timeout)

    fake = Flaky(watches=[Watch([update(1, ("expert-0", "expert-1"))], "hang")])

    async def main():
        follower = ControlFollower("127.0.0.1:9", TEST_RPC)
        follower.stub = fake
        await follower.first_placement(5)
        await follower.start(FakeExperts(), "127.0.0.1:7")
        fake.known = False
        await until(lambda: len(fake.registrations) >= 3, "the replica registers again after a failed registration")
        fake.known = True
        await until(lambda: fake.heartbeats[-1].id == follower.replica_id, "heartbeats go on under the new id")
        await follower.close()

    asyncio.run(main())
    assert fake.registrations[1] is None and fake.registrations[2].placement_version == 1
