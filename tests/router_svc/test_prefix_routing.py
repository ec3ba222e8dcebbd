"""Prefix-aware routing without gRPC: the per-replica prefix index, ReplicaSet.pick's choice between
the prefix holder and the least loaded, and the Router hashing prompts with the replicas' block size."""
import asyncio
from dataclasses import replace

import pytest

from moemesh.block_hash import block_hashes
from router_svc.admission import Admission
from router_svc.prefix_index import PrefixIndex
from router_svc.replicas import Replica, ReplicaSet
from router_svc.router import Router
from moemesh.contracts.info import LoadReport
from router_svc.types import GenerationInput
from tests.router_svc.fakes import FakeAttention

SYSTEM = list(range(100, 132))  # 8 blocks of 4


def keys(ids):
    return block_hashes(ids, 4)


def test_index_matches_leading_blocks_only():
    idx = PrefixIndex()
    idx.insert(keys(SYSTEM + [1, 2, 3, 4]))
    assert idx.match(keys(SYSTEM + [1, 2, 3, 4, 5])) == 9
    assert idx.match(keys(SYSTEM[:12] + [0, 0, 0, 0] + SYSTEM[16:])) == 3
    assert idx.match(keys([7] * 8)) == 0


def test_index_forgets_continuations_before_their_prefix():
    idx = PrefixIndex(capacity=10)
    idx.insert(keys(SYSTEM + [1, 2, 3, 4]))  # 9 keys
    idx.insert(keys([5] * 8))  # 2 more: one key must go
    assert len(idx) == 10
    assert idx.match(keys(SYSTEM)) == 8  # the continuation block went, the shared prefix stayed
    assert idx.match(keys(SYSTEM + [1, 2, 3, 4])) == 8


def two(prefix_imbalance=2):
    a, b = Replica("a", None), Replica("b", None)
    return a, b, ReplicaSet([a, b], prefix_imbalance)


def test_a_repeated_prefix_goes_where_it_went_before():
    a, b, rs = two()
    first = rs.pick(prefix=keys(SYSTEM + [1] * 4))
    other = b if first is a else a
    other.inflight = 1  # even when the holder is not the least loaded
    first.inflight = 2
    assert rs.pick(prefix=keys(SYSTEM + [2] * 4)) is first


def test_the_holder_gives_way_when_too_loaded():
    a, b, rs = two(prefix_imbalance=2)
    holder = rs.pick(prefix=keys(SYSTEM))
    other = b if holder is a else a
    holder.inflight = 3
    assert rs.pick(prefix=keys(SYSTEM + [9] * 4)) is other  # 3 - 0 > 2
    assert other.prefixes.match(keys(SYSTEM)) == 8  # now both hold it
    holder.inflight, other.inflight = 2, 0
    assert rs.pick(prefix=keys([3] * 16)) is other  # no match anywhere: least loaded


def test_distinct_prefixes_spread_by_load():
    a, b, rs = two()
    chosen = []
    for i in range(6):
        r = rs.pick(prefix=keys([i] * 16))
        r.inflight += 1
        chosen.append(r.address)
    assert sorted(chosen) == ["a"] * 3 + ["b"] * 3


def test_prefix_routing_off_is_least_loaded():
    a, b, rs = two(prefix_imbalance=None)
    r = rs.pick(prefix=keys(SYSTEM))
    r.inflight += 1
    assert rs.pick(prefix=keys(SYSTEM)) is not r
    assert len(a.prefixes) == len(b.prefixes) == 0


def test_index_capacity_follows_the_load_report():
    a = Replica("a", None)
    a.record(LoadReport(total_blocks=12), 0)
    assert a.prefixes.capacity == 12
    with pytest.raises(ValueError, match="prefix_imbalance"):
        ReplicaSet([a], prefix_imbalance=-1)


def routed(info, prompts, prefix_imbalance=4, cached_tokens=None):
    fakes = [FakeAttention([5, 6], address=name, cached_tokens=cached_tokens) for name in ("a", "b")]
    rs = ReplicaSet([Replica(f.address, f) for f in fakes], prefix_imbalance)
    router = Router(info, rs, Admission(8, 8))

    async def run(p):
        return [item async for item in router.generate(GenerationInput(prompt_token_ids=tuple(p)))]

    finals = [asyncio.run(run(p))[-1] for p in prompts]
    return fakes, finals


def test_router_sends_a_shared_prefix_to_one_replica_and_reports_cached_tokens(info):
    info = replace(info, kv_block_size=4, prefix_caching=True)
    prompts = [SYSTEM[:24] + [i, i + 1] for i in range(6)]
    fakes, finals = routed(info, prompts, cached_tokens=24)
    assert sorted(len(f.specs) for f in fakes) == [0, 6]
    assert all(f.cached_tokens == 24 for f in finals)


def test_router_without_replica_caching_spreads(info):
    info = replace(info, kv_block_size=4, prefix_caching=False)
    fakes, finals = routed(info, [SYSTEM[:24] + [i] for i in range(6)])
    assert sorted(len(f.specs) for f in fakes) == [3, 3]  # sequential requests alternate (round-robin ties)
    assert all(f.cached_tokens == 0 for f in finals)
