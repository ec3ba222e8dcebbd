import pytest
import torch

from moemesh.engine.kv_cache import BlockAllocator, KVCache


def test_allocate_and_free_counts():
    a = BlockAllocator(5)
    got = a.allocate(3)
    assert len(set(got)) == 3 and a.num_free == 2
    with pytest.raises(ValueError, match="cannot allocate 3 blocks, 2 free"):
        a.allocate(3)
    a.free(got)
    assert a.num_free == 5


def test_cache_shapes():
    kv = KVCache(num_layers=2, num_blocks=4, block_size=8, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    assert len(kv.layers) == 2 and kv.layers[0][0].shape == (4, 8, 2, 16) and kv.layers[0][1].dtype == torch.bfloat16
    assert kv.blocks_for(8) == 1 and kv.blocks_for(9) == 2
