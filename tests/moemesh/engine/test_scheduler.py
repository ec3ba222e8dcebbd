"""Scheduler without a model: the token budget, decodes before prompt chunks, prompts longer than the
budget, prefix cache hits, eviction, preemption with shared blocks, and the recurrent-state slots
of hybrid models (taken at admission, given back on finish, abort and preemption, never leaked)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from moemesh.engine.block_pool import BlockPool
from moemesh.engine.request import Request
from moemesh.engine.sampling_params import SamplingParams
from moemesh.engine.scheduler import Scheduler

BS = 4


def request(rid: str, prompt, max_new: int = 4, prompt_logprobs: bool = False) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_new_tokens=max_new), None, frozenset(),
                   prompt_logprobs=[None] if prompt_logprobs else None)


def scheduler(num_blocks: int = 64, budget: int = 16, max_seqs: int = 8, caching: bool = True) -> Scheduler:
    return Scheduler(BlockPool(num_blocks, caching), BS, max_seqs, budget)


def step(s: Scheduler, token: int = 7):
    """Schedule, 'run' (commit every chunk), append `token` to each request whose chunk completed it,
    and remove the requests that reached max_new_tokens. Returns the batch."""
    batch = s.schedule()
    for c in batch.chunks:
        s.commit(c)
    for c in batch.chunks:
        if c.completes:
            r = c.request
            r.output_token_ids.append(token)
            if len(r.output_token_ids) >= r.params.max_new_tokens:
                s.remove(r)
    return batch


def shape(batch):
    return [(c.request.request_id, c.start, c.num_tokens) for c in batch.chunks]


def test_a_prompt_longer_than_the_budget_runs_in_chunks():
    s = scheduler(budget=8)
    r = request("long", range(100, 130), max_new=2)  # 30 tokens, budget 8
    s.add(r)
    shapes = [shape(step(s)) for _ in range(4)]
    assert shapes == [[("long", 0, 8)], [("long", 8, 8)], [("long", 16, 8)], [("long", 24, 6)]]
    assert r.output_token_ids == [7] and r.num_computed == 30
    assert shape(step(s)) == [("long", 30, 1)]  # then it decodes
    assert not s.has_unfinished() and s.pool.num_free == 64


def test_decodes_come_first_then_chunks_within_the_budget():
    s = scheduler(budget=6)
    a, b = request("a", range(1, 4), max_new=10), request("b", range(10, 13), max_new=10)
    s.add(a)
    s.add(b)
    assert shape(step(s)) == [("a", 0, 3), ("b", 0, 3)]
    s.add(request("long", range(200, 220), max_new=1))
    for start in (0, 4, 8, 12, 16):
        batch = step(s)
        assert batch.num_tokens <= 6
        assert shape(batch)[:2] == [("a", batch.chunks[0].start, 1), ("b", batch.chunks[1].start, 1)]
        assert shape(batch)[2] == ("long", start, 4)  # the prompt gets what the decodes leave
    assert s.find("long") is None  # finished: its one token was sampled after the last chunk
    assert len(a.output_token_ids) == 6 and len(b.output_token_ids) == 6


def test_a_running_chunk_goes_before_new_prompts():
    s = scheduler(budget=5)
    for rid, base in (("x", 0), ("y", 100), ("z", 200)):
        s.add(request(rid, range(base, base + 7), max_new=1))
    assert shape(step(s)) == [("x", 0, 5)]
    assert shape(step(s)) == [("x", 5, 2), ("y", 0, 3)]
    assert shape(step(s)) == [("y", 3, 4), ("z", 0, 1)]


def test_max_num_seqs_bounds_the_running_requests():
    s = scheduler(budget=100, max_seqs=2)
    for rid in "xyz":
        s.add(request(rid, range(3), max_new=2))
    assert [c.request.request_id for c in step(s).chunks] == ["x", "y"]
    assert [c.request.request_id for c in step(s).chunks] == ["x", "y"]  # their last decodes
    assert [c.request.request_id for c in step(s).chunks] == ["z"]


def test_cache_hit_skips_the_shared_full_blocks():
    s = scheduler()
    shared = list(range(50, 58))  # two full blocks
    a = request("a", shared + [1, 2, 3], max_new=1)
    s.add(a)
    step(s)
    assert s.find("a") is None  # finished; its full blocks stay cached
    b = request("b", shared + [9, 9], max_new=2)
    s.add(b)
    assert shape(step(s)) == [("b", 8, 2)]
    assert b.cached_tokens == 8 and b.block_table[:2] == [0, 1]
    assert (s.stats.prefix_queries, s.stats.prefix_hits) == (11 + 10, 8)
    step(s)
    c = request("c", [50, 51, 52, 53, 0, 0, 0, 0, 0])  # only the first block matches
    s.add(c)
    assert shape(step(s)) == [("c", 4, 5)] and c.cached_tokens == 4


def test_the_last_prompt_token_is_always_computed():
    s = scheduler()
    prompt = list(range(30, 38))  # exactly two blocks
    s.add(request("a", prompt, max_new=1))
    step(s)
    b = request("b", prompt, max_new=1)
    s.add(b)
    assert shape(step(s)) == [("b", 4, 4)]  # the second block holds the last token: computed again
    assert b.cached_tokens == 4


def test_shared_blocks_while_both_run_and_generated_tokens_are_cached_too():
    s = scheduler()
    a = request("a", range(60, 66), max_new=8)  # 6 prompt tokens
    s.add(a)
    step(s)
    step(s)
    step(s)  # a now holds 6 prompt + 2 computed generated tokens: two full blocks
    assert a.num_registered == 2
    b = request("b", a.all_token_ids[:8] + [1])
    s.add(b)
    assert shape(step(s))[-1] == ("b", 8, 1)
    assert b.block_table[:2] == a.block_table[:2]
    assert [s.pool.ref_count(x) for x in a.block_table[:2]] == [2, 2]


def test_prompt_logprobs_requests_skip_the_lookup_but_fill_the_cache():
    s = scheduler()
    prompt = list(range(70, 79))
    s.add(request("a", prompt, max_new=1, prompt_logprobs=True))
    assert shape(step(s)) == [("a", 0, 9)]
    s.add(request("b", prompt, max_new=1, prompt_logprobs=True))
    assert shape(step(s)) == [("b", 0, 9)]
    assert (s.stats.prefix_queries, s.stats.prefix_hits) == (0, 0)
    s.add(request("c", prompt, max_new=1))
    assert shape(step(s)) == [("c", 8, 1)]


def test_caching_off_never_hits():
    s = scheduler(caching=False)
    for rid in "ab":
        s.add(request(rid, range(10, 19), max_new=1))
        assert shape(step(s)) == [(rid, 0, 9)]
    assert s.pool.num_cached == 0


def test_cached_blocks_are_evicted_least_recently_released_when_needed():
    s = scheduler(num_blocks=6)
    s.add(request("a", range(0, 8), max_new=1))
    step(s)
    s.add(request("b", range(100, 108), max_new=1))
    step(s)
    assert s.pool.num_free == 6 and s.pool.num_cached == 4  # nothing runs: every cached block counts as free
    s.add(request("c", range(200, 216), max_new=1))  # 4 blocks: the 2 free ones, then a's two (released first)
    assert shape(step(s)) == [("c", 0, 16)]
    s.add(request("d", list(range(100, 108)) + [5], max_new=1))
    assert shape(step(s)) == [("d", 8, 1)]  # b's blocks survived
    e = request("e", list(range(0, 8)) + [5], max_new=1)
    s.add(e)
    assert shape(step(s)) == [("e", 0, 9)] and e.cached_tokens == 0


def test_preemption_never_frees_blocks_another_request_uses():
    s = scheduler(num_blocks=5, budget=16)
    shared = list(range(40, 48))
    a = request("a", shared + [1], max_new=20)
    s.add(a)
    step(s)  # a: 9 tokens computed, 3 blocks, 2 of them keyed
    b = request("b", shared + [2], max_new=20)
    s.add(b)
    step(s)  # b shares a's two blocks and takes one of its own: 4 of 5 blocks in use
    assert b.block_table[:2] == a.block_table[:2] and s.pool.num_free == 1
    a_blocks = list(a.block_table)
    preempted = []
    for _ in range(4):  # the decodes fill the blocks: b (admitted last) is preempted
        preempted += step(s).preempted
    assert preempted == [b] and s.stats.preemptions == 1
    assert s.find("a") is a and a.block_table[:3] == a_blocks
    assert all(s.pool.ref_count(x) == 1 for x in a.block_table)
    assert s.waiting[0] is b and b.block_table == [] and b.num_computed == 0
    assert len(b.output_token_ids) == 4  # kept: recomputed with the prompt when b runs again


def test_a_victim_scheduled_earlier_in_the_step_is_unscheduled():
    s = scheduler(num_blocks=3, budget=16)
    p = request("p", range(0, 12))  # a prompt with 4 of its 12 tokens computed
    p.block_table, p.num_computed = s.pool.allocate(1), 4
    d = request("d", range(100, 103))  # a decode: 3 prompt tokens computed, 1 generated
    d.output_token_ids, d.block_table, d.num_computed = [5], s.pool.allocate(1), 3
    s.running = [p, d]
    batch = s.schedule()  # d is scheduled first, then p's chunk needs 2 blocks with 1 free: d is the victim
    assert shape(batch) == [("p", 4, 8)] and batch.preempted == (d,)
    assert s.running == [p] and list(s.waiting) == [d] and len(p.block_table) == 3
    assert s.pool.num_free == 0


def test_no_request_is_admitted_in_a_step_that_preempted():
    s = scheduler(num_blocks=3, budget=16)
    s.add(request("a", range(0, 4), max_new=9))
    step(s)  # a: 1 block
    b = request("b", range(10, 13), max_new=9)
    s.add(b)
    step(s)  # a: 2 blocks, b: 1 block
    step(s)
    c = request("c", [1])
    s.add(c)
    batch = step(s)  # b needs a second block: none left, b is preempted; c would fit in b's block now
    assert batch.preempted == (b,) and shape(batch) == [("a", 6, 1)]
    assert list(s.waiting) == [b, c]
    assert shape(step(s)) == [("a", 7, 1)]  # b now needs 2 blocks for its 5 tokens; c waits behind it (first come)
    assert list(s.waiting) == [b, c]


def test_preempted_request_reuses_its_own_cached_blocks():
    s = scheduler(num_blocks=4, budget=16)
    a = request("a", range(0, 8), max_new=3)
    b = request("b", range(100, 106), max_new=12)
    s.add(a)
    s.add(b)
    assert shape(step(s)) == [("a", 0, 8), ("b", 0, 6)]  # all 4 blocks; b's first one is full and keyed
    batch = step(s)  # a needs a third block: b is preempted, its keyed block stays cached
    assert shape(batch) == [("a", 8, 1)] and batch.preempted == (b,)
    assert shape(step(s)) == [("a", 9, 1)]  # a finishes
    assert shape(step(s)) == [("b", 4, 3)]  # b: prompt + its one generated token, the first block from the cache
    assert b.cached_tokens == 0  # usage reports what the first run found


def test_decodes_beyond_the_budget_all_run_and_prompts_wait():
    s = scheduler(budget=4)
    for rid in "abcd":
        s.add(request(rid, [ord(rid)], max_new=5))
    assert len(step(s).chunks) == 4  # four one-token prompts
    s.max_num_batched_tokens = 2  # fewer than the running decodes
    s.add(request("w", [1, 2, 3]))
    for _ in range(3):
        batch = step(s)
        assert shape(batch) == [(rid, batch.chunks[0].start, 1) for rid in "abcd"] and s.waiting[0].request_id == "w"
    step(s)  # their last decodes
    assert shape(step(s)) == [("w", 0, 2)]


@pytest.mark.parametrize("budget", [1, 3])
def test_every_step_stays_within_the_budget(budget):
    s = scheduler(budget=budget, max_seqs=1)
    s.add(request("a", range(0, 10), max_new=3))
    s.add(request("b", range(20, 25), max_new=3))
    while s.has_unfinished():
        assert step(s).num_tokens <= budget


def test_state_slots_follow_admission_finish_abort_and_preemption():
    slots = BlockPool(2, caching=False)
    s = Scheduler(BlockPool(3, caching=False), BS, 2, 16, state_slots=slots)
    a = request("a", range(0, 4), max_new=9)
    s.add(a)
    assert a.state_slot == -1  # waiting: no slot yet
    step(s)
    b = request("b", range(10, 13), max_new=9)
    s.add(b)
    step(s)
    assert {a.state_slot, b.state_slot} == {0, 1} and slots.num_free == 0
    step(s)
    batch = step(s)  # b needs a second block: none left, b is preempted and gives its slot back
    assert batch.preempted == (b,) and b.state_slot == -1 and slots.num_free == 1
    s.remove(a)  # finished or aborted: its slot goes back too
    assert a.state_slot == -1 and slots.num_free == 2
    step(s)  # b runs again from position 0 in a slot of its own
    assert b.state_slot >= 0 and b.num_computed > 0 and slots.num_free == 1


def test_fewer_state_slots_than_sequences_is_refused():
    with pytest.raises(ValueError, match="state_slots"):
        Scheduler(BlockPool(8), BS, 4, 16, state_slots=BlockPool(3, caching=False))


def held_slots_match_running(s: Scheduler, slots: BlockPool) -> None:
    """Every running request holds its own slot, no waiting one holds any, and no other slot is taken."""
    held = [r.state_slot for r in s.running]
    assert all(slot >= 0 for slot in held) and len(set(held)) == len(held)
    assert all(r.state_slot == -1 for r in s.waiting)
    assert slots.num_free == slots.num_blocks - len(held)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(1, 14), st.integers(1, 6)),  # prompt length, max_new
            st.tuples(st.just("step"), st.integers(1, 3), st.none()),  # steps in a row
            st.tuples(st.just("abort"), st.integers(0, 63), st.none()),  # which live request
        ),
        max_size=40,
    ),
    num_blocks=st.integers(5, 10),  # the longest request (19 tokens computed) fits alone
    caching=st.booleans(),
)
def test_state_slots_are_never_leaked(ops, num_blocks, caching):
    """Random arrivals, steps (with preemption when the few blocks run out) and aborts of waiting or
    running requests: after every operation the slots held are exactly the running requests' own, and
    once everything has finished or been aborted every slot is free again."""
    slots = BlockPool(3, caching=False)
    s = Scheduler(BlockPool(num_blocks, caching=caching), BS, 3, 8, state_slots=slots)
    live: list[Request] = []
    for i, (op, a, b) in enumerate(ops):
        if op == "add":
            req = request(f"r{i}", range(i, i + a), max_new=b)
            s.add(req)
            live.append(req)
        elif op == "step":
            for _ in range(a):
                step(s)
        elif live:
            s.remove(live.pop(a % len(live)))
        live = [r for r in live if s.find(r.request_id) is r]
        held_slots_match_running(s, slots)
    for _ in range(200):
        if not s.has_unfinished():
            break
        step(s)
        held_slots_match_running(s, slots)
    assert not s.has_unfinished() and slots.num_free == slots.num_blocks
