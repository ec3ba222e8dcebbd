import torch

from moemesh.engine.kv_cache import KVCache


def test_cache_shapes():
    kv = KVCache(num_layers=2, num_blocks=4, block_size=8, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    assert len(kv.layers) == 2 and kv.layers[0][0].shape == (4, 8, 2, 16) and kv.layers[0][1].dtype == torch.bfloat16
    assert kv.blocks_for(8) == 1 and kv.blocks_for(9) == 2
    assert kv.allocator.num_blocks == 4 and kv.allocator.caching
    assert not KVCache(1, 2, 4, 1, 8, torch.float32, prefix_caching=False).allocator.caching
