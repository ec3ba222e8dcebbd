"""The checks every newer family is held to through LLMEngine: prompt logprobs within 1e-4 of
transformers (float32), the same greedy continuation, and the generated tokens' logprobs (decode
steps over the cache) within 1e-4 of a full transformers forward; the same for a workload of prompts
sharing prefixes, joining and leaving, run with prefix caching, chunked prefill, preemption or two
micro-batches."""
from __future__ import annotations

import copy

from moemesh.engine.outputs import GenerationResult
from moemesh.engine.sampling_params import SamplingParams
from tests.fixtures.shared_prefix import JOINS, params_for, shared_prefix_prompts, staggered
from tests.moemesh.models.arch.engine_helpers import make_engine
from tests.moemesh.models.arch.reference import assert_logprobs_close, greedy, prompt_logprobs
from tests.moemesh.models.tiny_families import GREEDY_TOKENS, PROMPTS


def run_prompts(engine, prompts, new_tokens: int = GREEDY_TOKENS):
    """Greedy, with prompt logprobs, all prompts batched together."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, prompt_logprobs=True, ignore_eos=True)
    return engine.generate([list(p) for p in prompts], params)


def check_engine_matches(checkpoint, **engine_kw) -> None:
    path, ref, expected = checkpoint
    engine = make_engine(path, **engine_kw)
    for prompt, res in zip(PROMPTS, run_prompts(engine, PROMPTS)):
        ref_plp, ref_tokens = expected[prompt]
        assert_logprobs_close(res.prompt_logprobs, ref_plp)
        assert res.token_ids == ref_tokens
        full = prompt_logprobs(ref, list(prompt) + res.token_ids)[len(prompt):]
        assert max(abs(a - b) for a, b in zip(res.logprobs, full)) < 1e-4


def shared_prefix_reference(ref) -> tuple[dict[str, list[int]], dict[str, GenerationResult]]:
    """The shared-prefix workload (tests/fixtures/shared_prefix.py, `e` continuing transformers' greedy
    answer to `a`) and what transformers gives for each prompt: its greedy tokens, their logprobs from a
    full forward, and the prompt logprobs where the workload asks for them."""
    first = shared_prefix_prompts()
    prompts = shared_prefix_prompts(answer=greedy(ref, first["a"], 6))
    expected = {}
    for rid, p in prompts.items():
        params = params_for(rid)
        tokens = greedy(ref, p, params.max_new_tokens)
        lps = prompt_logprobs(ref, p + tokens)
        plp = lps[: len(p)] if params.prompt_logprobs else None
        expected[rid] = GenerationResult(rid, p, tokens, lps[len(p):], "length", plp)
    return prompts, expected


def float64_logprobs(ref, ids: list[int]) -> list[float | None]:
    """`prompt_logprobs` of a float64 copy of `ref`: the exact values float32 runs approximate."""
    exact = copy.deepcopy(ref).double()
    for module in exact.modules():
        config = getattr(module, "config", None)
        if config is not None:
            config._experts_implementation = "eager"  # torch's grouped_mm takes no float64
    return prompt_logprobs(exact, ids)


def assert_near_transformers(ref, ids: list[int], start: int, got: list[float], want: list[float], tol: float = 1e-4) -> None:
    """got / want: logprobs of ids[start:] from the engine / from transformers in float32. Each value is
    within `tol` of transformers', or, where float32 itself is ill-conditioned (e.g. the gated RMSNorm
    of a Gated DeltaNet head whose output nearly cancels, scaled back up), no farther from the exact
    float64 value than transformers' float32 is."""
    assert len(got) == len(want)
    far = [i for i, (g, w) in enumerate(zip(got, want)) if abs(g - w) >= tol]
    if not far:
        return
    exact = float64_logprobs(ref, ids)[start:]
    for i in far:
        assert abs(got[i] - exact[i]) <= abs(want[i] - exact[i]), (
            f"logprob of position {start + i}: {got[i]} vs transformers {want[i]}, exact {exact[i]}")


def check_staggered(checkpoint, joins=JOINS, **engine_kw):
    """The shared-prefix workload with sequences joining and leaving (`joins`) through an engine built
    with `engine_kw` gives transformers' greedy tokens, and their logprobs (and the prompt logprobs
    where asked) as `assert_near_transformers` holds them; every block (and state slot) is free at the
    end. Returns (engine, per-request results)."""
    path, ref, _ = checkpoint
    prompts, expected = shared_prefix_reference(ref)
    engine = make_engine(path, **{"max_num_seqs": 8, **engine_kw})
    got = staggered(engine, prompts, joins)
    for rid, want in expected.items():
        g, ids = got[rid], prompts[rid] + want.token_ids
        assert g["tokens"] == want.token_ids, rid
        assert_near_transformers(ref, ids, len(prompts[rid]), g["logprobs"], want.logprobs)
        if want.prompt_logprobs is not None:
            assert g["prompt_logprobs"][0] is None
            assert_near_transformers(ref, ids, 1, g["prompt_logprobs"][1:], want.prompt_logprobs[1:])
    assert not engine.has_unfinished() and engine.num_free_blocks == engine.kv.allocator.num_blocks
    if engine.state is not None:
        assert engine.state.slots.num_free == engine.config.max_num_seqs
    return engine, got
