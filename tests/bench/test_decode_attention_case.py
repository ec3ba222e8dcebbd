"""bench/decode_attention.py's cases: what it times is a decode step's attention (its run is the lead's)."""
from __future__ import annotations

import torch

from bench.decode_attention import decode_case


def test_each_sequence_decodes_its_last_position_over_blocks_of_its_own():
    q, k, v, kc, vc, meta = decode_case(3, 40, 8, 2, 16, 16, torch.float32)
    assert q.shape == (3, 8, 16) and k.shape == v.shape == (3, 2, 16) and kc.shape == vc.shape == (9, 16, 2, 16)
    assert meta.num_decode == 3 and not meta.chunks
    assert meta.decode_mask.sum(1).tolist() == [40, 40, 40]
    blocks = meta.decode_block_tables  # [B, NB]
    assert blocks.shape == (3, 3) and blocks.flatten().unique().numel() == 9
    assert torch.equal(meta.slot_mapping, blocks[:, 2] * 16 + 7)  # position 39: block 2, offset 7
