"""MiniMax-M2 through LLMEngine vs transformers (fp32): partial and full rotary, GQA and MHA."""
from __future__ import annotations

import pytest

from tests.moemesh.models.engine_vs_transformers import check_engine_matches


@pytest.mark.parametrize("family_checkpoint", ["minimax_m2", "minimax_m2_full_rope"], indirect=True)
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_matches_transformers(family_checkpoint, micro_batches):
    check_engine_matches(family_checkpoint, micro_batches=micro_batches)
