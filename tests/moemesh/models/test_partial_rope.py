"""Partial rotary run as a permuted full-width rope: the permutation is a bijection that puts every
rotated pair where the full-width rope expects it."""
from __future__ import annotations

import pytest

from moemesh.models.partial_rope import head_permutation


@pytest.mark.parametrize("head_dim, rotary_dim", [(16, 8), (16, 4), (16, 16), (128, 64), (10, 6)])
def test_permutation_is_a_bijection_with_rotated_pairs_in_place(head_dim, rotary_dim):
    perm = head_permutation(head_dim, rotary_dim)
    assert sorted(perm.tolist()) == list(range(head_dim))
    half, rhalf = head_dim // 2, rotary_dim // 2
    for i in range(rhalf):  # partial pair (i, i + D/2) lands on full-width pair (i, i + Dh/2)
        assert (perm[i].item(), perm[half + i].item()) == (i, i + rhalf)


def test_bad_rotary_dim_names_the_field():
    with pytest.raises(ValueError, match="rotary_dim"):
        head_permutation(16, 5)
