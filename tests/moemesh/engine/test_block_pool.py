"""BlockPool: reference counts, the prefix cache's keys, least-recently-released eviction."""
import pytest

from moemesh.block_hash import block_hashes, hash_block
from moemesh.engine.block_pool import BlockPool


def keys(n):
    return block_hashes(list(range(4 * n)), 4)


def test_allocate_and_release_counts():
    pool = BlockPool(5)
    got = pool.allocate(3)
    assert len(set(got)) == 3 and pool.num_free == 2
    with pytest.raises(ValueError, match="cannot allocate 3 blocks, 2 free"):
        pool.allocate(3)
    pool.release(got)
    assert pool.num_free == 5
    with pytest.raises(ValueError, match="not in use"):
        pool.release([got[0]])


def test_keyed_blocks_stay_cached_count_as_free_and_are_found():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    k = keys(3)
    for b, h in zip(blocks, k):
        assert pool.register(b, h)
    pool.release(blocks)
    assert pool.num_free == 4 and pool.num_cached == 3
    assert pool.lookup(k) == blocks
    assert pool.lookup([k[0], hash_block(k[0], [9, 9, 9, 9]), k[2]]) == blocks[:1]  # stops at the first miss


def test_shared_block_survives_one_holder_releasing():
    pool = BlockPool(4)
    a = pool.allocate(2)
    k = keys(2)
    pool.register(a[0], k[0])
    pool.register(a[1], k[1])
    hits = pool.lookup(k)
    pool.acquire(hits)  # a second sequence shares both
    assert [pool.ref_count(b) for b in a] == [2, 2]
    pool.release(a)  # the first one goes (finished or preempted)
    assert [pool.ref_count(b) for b in a] == [1, 1]
    assert pool.num_free == 2  # still in use: neither free nor evictable
    fresh = pool.allocate(2)
    assert not set(fresh) & set(a)


def test_eviction_takes_free_blocks_first_then_least_recently_released():
    pool = BlockPool(4)
    first, second = pool.allocate(2), pool.allocate(2)
    k1 = block_hashes([1] * 8, 4)
    k2 = block_hashes([2] * 8, 4)
    for b, h in zip(first, k1):
        pool.register(b, h)
    for b, h in zip(second, k2):
        pool.register(b, h)
    pool.release(first)
    pool.release(second)
    one = pool.allocate(1)  # no free block: evicts the least recently released, the tail of `first`
    assert one == [first[1]]
    assert pool.lookup(k1) == [first[0]] and pool.lookup(k2) == second
    pool.acquire(pool.lookup(k2))  # a hit makes them not evictable
    assert pool.allocate(1) == [first[0]]
    assert pool.lookup(k1) == [] and pool.num_free == 0


def test_a_key_already_held_is_not_registered_twice():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    h = keys(1)[0]
    assert pool.register(a, h)
    assert not pool.register(b, h)
    pool.release([b])
    assert pool.num_free == 2 and pool.num_cached == 1  # b went back as a plain free block
    assert pool.lookup([h]) == [a]


def test_caching_off_keys_nothing():
    pool = BlockPool(2, caching=False)
    blocks = pool.allocate(1)
    assert not pool.register(blocks[0], keys(1)[0])
    pool.release(blocks)
    assert pool.lookup(keys(1)) == [] and pool.num_free == 2


def test_only_used_or_cached_blocks_can_be_shared():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="free"):
        pool.acquire([0])
