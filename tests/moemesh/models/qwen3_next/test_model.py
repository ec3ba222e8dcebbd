"""Qwen3-Next and Qwen3.5-MoE (text, and a VL checkpoint's text model) against transformers (float32),
driven below the engine with continuous batching: sequences join mid-batch and leave, a slot is reused
by a new sequence without being cleared, prefills run the chunked delta rule (one prompt spans two
chunks) and decodes the recurrent step. Prompt logprobs within 1e-4, greedy tokens identical, each
generated token's logprob within 1e-4 of a full transformers forward."""
from __future__ import annotations

import pytest

from tests.moemesh.models.arch.reference import assert_logprobs_close, prompt_logprobs
from tests.moemesh.models.qwen3_next.driver import Driver
from tests.moemesh.models.tiny_families import GREEDY_TOKENS, PROMPTS

HYBRID = ["qwen3_next", "qwen3_next_plain", "qwen3_5_moe", "qwen3_5_moe_vl"]


def check(seq, prompt, ref, expected) -> None:
    ref_plp, ref_tokens = expected[prompt]
    assert_logprobs_close(seq.prompt_logprobs, ref_plp)
    generated = seq.tokens[len(prompt):]
    assert generated == ref_tokens[: len(generated)]
    full = prompt_logprobs(ref, seq.tokens)[len(prompt):]
    assert max(abs(a - b) for a, b in zip(seq.logprobs, full)) < 1e-4


@pytest.mark.parametrize("family_checkpoint", HYBRID, indirect=True)
def test_continuous_batching_matches_transformers(family_checkpoint):
    path, ref, expected = family_checkpoint
    a, b, c = PROMPTS
    drv = Driver(path, num_slots=3)
    drv.add("a", list(a))
    drv.add("b", list(b))
    drv.step()  # two prefills
    drv.add("c", list(c))  # joins while a and b decode: 2 decodes + 1 prefill (two delta-rule chunks)
    for _ in range(9):
        drv.step()
    done = {"b": drv.remove("b")}  # leaves after 10 tokens; its slot goes back, dirty
    drv.add("b2", list(b))  # takes that slot: must start from a zero state
    assert drv.seqs["b2"].slot == done["b"].slot
    while drv.seqs:
        drv.step()
        for name in [n for n, s in drv.seqs.items() if len(s.logprobs) == GREEDY_TOKENS]:
            done[name] = drv.remove(name)
    for name, prompt in (("a", a), ("b", b), ("c", c), ("b2", b)):
        check(done[name], prompt, ref, expected)
    assert drv.store.slots.num_free == 3
