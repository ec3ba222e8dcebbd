from moemesh.block_hash import block_hashes, extend_hashes, hash_block


def test_keys_chain_over_the_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2  # the partial third block has no key
    assert a[0] == hash_block(None, [1, 2, 3, 4]) and a[1] == hash_block(a[0], [5, 6, 7, 8])
    b = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[0] != b[0] and a[1] != b[1]  # same second block after a different first one


def test_extend_continues_and_respects_the_limit():
    ids = list(range(20))
    got = extend_hashes([], ids, 4, limit=2)
    assert got == block_hashes(ids, 4)[:2]
    assert extend_hashes(got, ids, 4) == block_hashes(ids, 4) and len(got) == 5
