"""What fails alone in the engine: sampling values that underflow are handled, a sequence whose
logits are not finite fails by itself, and a failed model run fails only the sequences in its batch."""
from __future__ import annotations

import math

import pytest
import torch

from moemesh.engine import EngineConfig, LLMEngine, SamplingParams, StepFailed

PROMPT_A = [5, 17, 301, 42, 9]
PROMPT_B = [400, 2, 8, 77, 123]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


def engine(path, **kw):
    return LLMEngine(EngineConfig(str(path), **{"block_size": 4, "kv_cache_tokens": 256, **kw}))


def run_all(e: LLMEngine) -> dict[str, list]:
    """Steps until nothing is left; request id -> its outputs."""
    got: dict[str, list] = {}
    while e.has_unfinished():
        for out in e.step():
            got.setdefault(out.request_id, []).append(out)
    return got


def tokens(outs) -> list[int]:
    return [o.token_id for o in outs if o.token_id is not None]


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    path, _ = tiny_ckpt("mixtral")
    return path


@pytest.fixture(scope="module")
def greedy_a(model):
    return engine(model).generate([PROMPT_A], GREEDY)[0].token_ids


@pytest.mark.parametrize("sampling", [
    dict(temperature=1e-300),
    dict(temperature=5e-324),
    dict(temperature=1e-7),
    dict(temperature=1.0, top_p=1e-300),  # 0 in float32: keeps the top token
    dict(temperature=1.0, top_p=1e-45),   # the smallest float32 subnormal
    dict(temperature=1.0, top_p=5e-324),
])
def test_underflowing_sampling_values_sample_the_top_token_next_to_a_normal_stream(model, greedy_a, sampling):
    e = engine(model)
    e.add_request("tiny", PROMPT_A, SamplingParams(max_new_tokens=6, ignore_eos=True, seed=3, **sampling))
    e.add_request("mate", PROMPT_B, SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.8, seed=1))
    got = run_all(e)
    assert tokens(got["tiny"]) == greedy_a
    assert all(o.error is None for outs in got.values() for o in outs)
    assert len(tokens(got["mate"])) == 6 and got["mate"][-1].finish_reason == "length"


@pytest.mark.parametrize("field, value", [
    ("temperature", math.inf), ("temperature", math.nan), ("temperature", -1e-300),
    ("top_p", math.nan), ("top_p", math.inf), ("top_p", 0.0), ("top_p", -math.inf),
    ("seed", 2**64), ("seed", -2**63 - 1), ("max_new_tokens", 0), ("top_k", -1),
])
def test_non_finite_or_out_of_range_values_are_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert str(e.value).startswith(f"{field}: ")


def test_greedy_below_the_epsilon():
    assert SamplingParams(temperature=1e-6).greedy and SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-3).greedy


def test_nan_logits_fail_that_sequence_alone(model):
    alone = engine(model).generate([PROMPT_B], GREEDY)[0].token_ids
    e = engine(model)
    run = e._run

    def poisoned(slices):  # the first sequence's logits turn NaN from its third step on
        rows = run(slices)
        if e.scheduler.find("bad") is not None and len(e.scheduler.find("bad").output_token_ids) >= 2:
            rows[0] = torch.full_like(rows[0], math.nan)
        return rows

    e._run = poisoned
    e.add_request("bad", PROMPT_A, GREEDY)
    e.add_request("good", PROMPT_B, GREEDY)
    got = run_all(e)
    bad = got["bad"][-1]
    assert bad.finished and bad.finish_reason == "error" and bad.token_id is None
    assert isinstance(bad.error, RuntimeError) and str(bad.error).startswith("logits: ")
    assert len(tokens(got["bad"])) == 2
    assert tokens(got["good"]) == alone and got["good"][-1].error is None
    assert e.num_free_blocks == e.kv.allocator.num_blocks


def test_a_failed_model_run_fails_only_its_batch(model, greedy_a):
    e = engine(model, max_num_seqs=1)  # "later" waits while "first" runs
    run = e._run
    calls = {"n": 0}

    def flaky(slices):
        calls["n"] += 1
        if calls["n"] == 2:
            raise ConnectionError("expert server gone")
        return run(slices)

    e._run = flaky
    e.add_request("first", PROMPT_B, GREEDY)
    e.add_request("aborted", PROMPT_B, GREEDY)
    assert e.step()[0].request_id == "first"  # first step: "first" prefills
    e.abort("aborted")  # its abort output is pending when the next step fails
    e.add_request("later", PROMPT_A, GREEDY)
    with pytest.raises(StepFailed) as failed:
        e.step()
    assert failed.value.request_ids == ("first",)
    assert isinstance(failed.value.cause, ConnectionError)
    assert e.scheduler.find("first") is None
    got = run_all(e)
    assert [o.finish_reason for o in got["aborted"]] == ["abort"]
    assert tokens(got["later"]) == greedy_a
    assert e.num_free_blocks == e.kv.allocator.num_blocks


def test_generate_raises_a_failed_sequences_error(model):
    e = engine(model)
    run = e._run

    def poisoned(slices):
        rows = run(slices)
        return [torch.full_like(r, math.nan) for r in rows]

    e._run = poisoned
    with pytest.raises(RuntimeError, match="^logits: "):
        e.generate([PROMPT_A], GREEDY)
    assert not e.has_unfinished()
