"""Attention replica discovery: names expand to one replica per address, refreshes add new pods and
retire vanished ones (drained, in-flight sequences finish), load-based choice across the expansion.
DNS is replaced by an injected resolver."""
import asyncio

import pytest

from moemesh.contracts.info import LoadReport
from moemesh.svc_config import from_sources
from router_svc.admission import Admission
from router_svc.config import RouterConfig
from router_svc.discovery import Discovery, parse_target
from router_svc.replicas import Replica, ReplicaSet
from router_svc.router import Router
from router_svc.types import GenerationInput
from tests.router_svc.fakes import FakeAttention
from tests.fixtures.auth import TEST_RPC, TEST_TOKEN


class FakeDNS:
    """name -> addresses (a list, or an exception to raise); records every lookup."""

    def __init__(self, records):
        self.records = dict(records)
        self.lookups = []

    async def __call__(self, host, port):
        self.lookups.append((host, port))
        answer = self.records.get(host, OSError(f"{host}: no such name"))
        if isinstance(answer, Exception):
            raise answer
        return list(answer)


class PodClient(FakeAttention):
    """One attention pod: scripted tokens, a load report, and whether its channel was closed."""

    def __init__(self, address, tokens=(10, 11, 12), delay_s=0.0, report=None):
        super().__init__(tokens, delay_s=delay_s, address=address)
        self.report = report or LoadReport()
        self.closed = False

    async def get_load(self, timeout):
        if self.closed:
            raise ConnectionError("channel closed")
        return self.report

    async def close(self):
        self.closed = True


class Pods:
    """make_client for discovery: one PodClient per address, kept for inspection."""

    def __init__(self, **kw):
        self.kw = kw
        self.clients: dict[str, PodClient] = {}

    def __call__(self, address):
        self.clients[address] = PodClient(address, **self.kw)
        return self.clients[address]


def initial_set(discovery, pods):
    addresses = asyncio.run(discovery.addresses())
    return ReplicaSet([Replica(a, pods(a)) for a in addresses])


def test_a_name_expands_to_every_address_and_literals_stay():
    dns = FakeDNS({"attention": ["10.0.0.1", "10.0.0.2", "10.0.0.1", "fd00::7"], "v6only": ["fd00::1", "fd00::2"]})
    d = Discovery(["attention:50052", "10.0.0.9:50052", "[fd00::9]:50052", "v6only:7000", "10.0.0.2:50052"], dns)
    assert asyncio.run(d.addresses()) == [
        "10.0.0.1:50052", "10.0.0.2:50052", "10.0.0.9:50052", "[fd00::9]:50052", "[fd00::1]:7000", "[fd00::2]:7000",
    ]
    assert dns.lookups == [("attention", 50052), ("v6only", 7000)]  # literal IPs are never looked up
    assert d.has_names and not Discovery(["10.0.0.9:1"], dns).has_names


@pytest.mark.parametrize("bad", ["attention", "attention:", ":50052", "attention:http", "attention:70000", "[::1]"])
def test_malformed_targets_name_the_field(bad):
    with pytest.raises(ValueError, match="attention"):
        parse_target(bad)


def test_no_target_is_an_error():
    with pytest.raises(ValueError, match="attention: at least one"):
        Discovery([], FakeDNS({}))


def test_a_failed_lookup_keeps_what_the_name_had():
    dns = FakeDNS({"attention": ["10.0.0.1", "10.0.0.2"]})
    d = Discovery(["attention:50052"], dns)
    assert asyncio.run(d.addresses()) == ["10.0.0.1:50052", "10.0.0.2:50052"]
    dns.records["attention"] = OSError("temporary failure in name resolution")
    assert asyncio.run(d.addresses()) == ["10.0.0.1:50052", "10.0.0.2:50052"]
    dns.records["attention"] = []
    assert asyncio.run(d.addresses()) == ["10.0.0.1:50052", "10.0.0.2:50052"]
    dns.records["attention"] = ["10.0.0.3"]
    assert asyncio.run(d.addresses()) == ["10.0.0.3:50052"]


def test_waiting_for_a_name_that_never_resolves_times_out():
    d = Discovery(["attention:50052"], FakeDNS({}))
    with pytest.raises(ValueError, match="attention: no address found for attention:50052"):
        asyncio.run(d.wait_for_addresses(timeout_s=0.05, retry_s=0.01))


def test_waiting_returns_once_the_name_resolves():
    dns = FakeDNS({})
    d = Discovery(["attention:50052"], dns)

    async def main():
        async def publish():
            await asyncio.sleep(0.03)
            dns.records["attention"] = ["10.0.0.4"]

        task = asyncio.create_task(publish())
        found = await d.wait_for_addresses(timeout_s=5, retry_s=0.01)
        await task
        return found

    assert asyncio.run(main()) == ["10.0.0.4:50052"]


def test_refresh_adds_new_pods_and_retires_vanished_ones():
    dns = FakeDNS({"attention": ["10.0.0.1", "10.0.0.2"]})
    d, pods = Discovery(["attention:50052"], dns), Pods()
    rs = initial_set(d, pods)
    dns.records["attention"] = ["10.0.0.2", "10.0.0.3"]
    asyncio.run(d.refresh(rs, pods, poll_timeout=1))
    assert [r.address for r in rs.replicas] == ["10.0.0.2:50052", "10.0.0.3:50052"]
    assert rs.replicas[1].available  # its first load report arrived during the refresh
    assert pods.clients["10.0.0.1:50052"].closed and rs.retiring == []  # nothing in flight: closed at once
    picked = {rs.pick(exclude=set()).address for _ in range(4)}
    assert picked == {"10.0.0.2:50052", "10.0.0.3:50052"}


def test_a_new_pod_that_does_not_answer_gets_nothing():
    dns = FakeDNS({"attention": ["10.0.0.1"]})
    d, pods = Discovery(["attention:50052"], dns), Pods()
    rs = initial_set(d, pods)
    dns.records["attention"] = ["10.0.0.1", "10.0.0.2"]

    def failing(address):
        client = pods(address)
        client.closed = True  # its load poll fails
        return client

    asyncio.run(d.refresh(rs, failing, poll_timeout=1))
    assert len(rs.replicas) == 2 and not rs.replicas[1].available
    assert all(rs.pick().address == "10.0.0.1:50052" for _ in range(3))


def test_in_flight_sequences_on_a_retired_pod_finish(info, tokenizer):
    dns = FakeDNS({"attention": ["10.0.0.1"]})
    d, pods = Discovery(["attention:50052"], dns), Pods(tokens=list(range(10, 30)), delay_s=0.005)
    rs = initial_set(d, pods)
    router = Router(info, rs, Admission(8, 8), tokenizer)
    old = pods.clients["10.0.0.1:50052"]

    async def main():
        running = asyncio.create_task(collect(router, GenerationInput(request_id="long", prompt_token_ids=(5,))))
        while not old.specs:
            await asyncio.sleep(0.001)
        dns.records["attention"] = ["10.0.0.2"]  # the pod is gone from DNS while its sequence runs
        await d.refresh(rs, pods, poll_timeout=1)
        assert [r.address for r in rs.retiring] == ["10.0.0.1:50052"] and not old.closed
        fresh = await collect(router, GenerationInput(request_id="new", prompt_token_ids=(5,)))
        items = await running
        await rs.sweep()
        return items, fresh

    items, fresh = asyncio.run(main())
    assert items[-1].finish_reason == "length" and items[-1].completion_tokens == 20
    assert [s.request_id for s in old.specs] == ["long"]  # no new sequence went to the retired pod
    assert fresh[-1].finish_reason == "length" and [s.request_id for s in pods.clients["10.0.0.2:50052"].specs] == ["new"]
    assert old.closed and rs.retiring == []


def test_a_retired_address_that_comes_back_is_active_again():
    dns = FakeDNS({"attention": ["10.0.0.1", "10.0.0.2"]})
    d, pods = Discovery(["attention:50052"], dns), Pods()
    rs = initial_set(d, pods)
    first = rs.replicas[0]
    first.inflight = 1  # a sequence still runs there
    dns.records["attention"] = ["10.0.0.2"]
    asyncio.run(d.refresh(rs, pods, poll_timeout=1))
    assert rs.retiring == [first] and first.retired
    dns.records["attention"] = ["10.0.0.2", "10.0.0.1"]
    asyncio.run(d.refresh(rs, pods, poll_timeout=1))
    assert first in rs.replicas and not first.retired and first.available and rs.retiring == []
    assert not first.client.closed


def test_least_loaded_choice_across_the_expanded_replicas():
    dns = FakeDNS({"attention": ["10.0.0.1", "10.0.0.2", "10.0.0.3"]})
    d = Discovery(["attention:50052"], dns)
    loads = {"10.0.0.1:50052": LoadReport(running=5), "10.0.0.2:50052": LoadReport(running=1), "10.0.0.3:50052": LoadReport(running=3)}
    rs = initial_set(d, lambda a: PodClient(a, report=loads[a]))
    asyncio.run(rs.refresh(timeout=1))
    order = []
    for _ in range(6):
        r = rs.pick()
        order.append(r.address)
        r.inflight += 1
    # .2 (load 1) takes two, then .2 and .3 share until both reach .1's load of 5
    assert order[:2] == ["10.0.0.2:50052"] * 2 and "10.0.0.1:50052" not in order
    counts = {a: r.inflight for a, r in ((r.address, r) for r in rs.replicas)}
    assert counts == {"10.0.0.1:50052": 0, "10.0.0.2:50052": 4, "10.0.0.3:50052": 2}


def test_the_discovery_interval_is_a_config_field():
    cfg = from_sources(RouterConfig, "router", None, {"MOEMESH_ROUTER_DISCOVERY_INTERVAL_S": "2.5", "MOEMESH_MESH_TOKEN": TEST_TOKEN})
    assert cfg.discovery_interval_s == 2.5
    assert RouterConfig(rpc=TEST_RPC).discovery_interval_s > 0
    with pytest.raises(ValueError, match="discovery_interval_s"):
        RouterConfig(discovery_interval_s=-1, rpc=TEST_RPC)


async def collect(router, req):
    return [item async for item in router.generate(req)]
