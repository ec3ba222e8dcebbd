"""Continuous batching with chunked prefill and a prefix cache.

Each step gets a token budget (`max_num_batched_tokens`) and fills it in this order:
  1. decodes: every running request with one token left to compute (its last sampled token); they
     always run (at most `max_num_seqs` of them), so a step with more decodes than the budget runs
     them all and no prompt chunk;
  2. prompt chunks of running requests whose prompt is not all computed yet (earlier chunks ran),
     up to what the decodes left of the budget;
  3. waiting requests, first come first served, while fewer than `max_num_seqs` run: each first
     takes the longest prefix of its full blocks found in the prefix cache (those tokens are not
     computed again; at least the last token always is, for its logits), then a chunk of what is
     left, up to the remaining budget.
A prompt longer than the budget thus runs over several steps while the decodes keep flowing.

A request gets blocks for the tokens it runs in the step. When none are left, the most recently
admitted running request is preempted: it drops its block references (blocks another request
shares stay in use; its own computed full blocks stay in the prefix cache) and goes back to the
head of the queue, to be recomputed (prompt and generated tokens, cache hits included). No
waiting request is admitted in a step that preempted.

After the model ran, `commit` advances each request by its chunk and keys its newly full blocks in
the prefix cache.

Models with recurrent layers hand the scheduler their state slots (`state_slots`): a request takes
one when it is admitted and gives it back with its blocks (finish, abort, preemption). There are
max_num_seqs slots, so an admitted request always finds one.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from moemesh.block_hash import extend_hashes
from moemesh.engine.block_pool import BlockPool
from moemesh.engine.request import Request


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's tokens in a step: positions [start, start + num_tokens) of its `all_token_ids`."""

    request: Request
    start: int
    num_tokens: int

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start : self.start + self.num_tokens]

    @property
    def completes(self) -> bool:
        """True when the chunk runs the request's last token: the step samples its next token."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass(frozen=True)
class ScheduledBatch:
    """chunks: decodes first (one token each), then prompt chunks; preempted: requests sent back to the queue."""

    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[Request, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.chunks

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass
class SchedulerStats:
    """Counters since start: prompt tokens looked up in the prefix cache (`prefix_queries`) and found
    there (`prefix_hits`); requests preempted (`preemptions`)."""

    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


class Scheduler:
    def __init__(
        self, pool: BlockPool, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
        state_slots: BlockPool | None = None,
    ) -> None:
        if state_slots is not None and state_slots.num_blocks < max_num_seqs:
            raise ValueError(f"state_slots: {state_slots.num_blocks} slots for max_num_seqs {max_num_seqs}")
        self.pool = pool
        self.state_slots = state_slots
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self.stats = SchedulerStats()

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Request | None:
        for req in (*self.running, *self.waiting):
            if req.request_id == request_id:
                return req
        return None

    def remove(self, req: Request) -> None:
        """Drop a finished or aborted request and release its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        scheduled: dict[Request, ScheduledChunk] = {}
        preempted: list[Request] = []
        decodes = [(r, 1) for r in self.running if r.num_tokens - r.num_computed == 1]
        chunks = [(r, None) for r in self.running if r.num_tokens - r.num_computed > 1]
        for req, n in decodes + chunks:
            if req not in self.running:  # preempted while making room for an earlier one
                continue
            n = n or min(req.num_tokens - req.num_computed, budget)  # a chunk gets what the budget has left
            if n <= 0:
                break
            while self._new_blocks(req, n) > self.pool.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim in scheduled:  # scheduled earlier in this step: give its tokens back
                    budget += scheduled.pop(victim).num_tokens
                if victim is req:
                    break
            if req not in self.running:
                continue
            req.block_table += self.pool.allocate(self._new_blocks(req, n))
            scheduled[req] = ScheduledChunk(req, req.num_computed, n)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            chunk = self._admit(self.waiting[0], budget)
            if chunk is None:
                break
            self.running.append(self.waiting.popleft())
            scheduled[chunk.request] = chunk
            budget -= chunk.num_tokens
        ordered = [scheduled[r] for r in self.running if r in scheduled]
        ordered.sort(key=lambda c: c.num_tokens > 1 or c.start == 0)  # decodes first (stable)
        return ScheduledBatch(tuple(ordered), tuple(preempted))

    def commit(self, chunk: ScheduledChunk) -> None:
        """After the step ran `chunk`: its tokens are computed; full blocks get their prefix-cache keys."""
        req = chunk.request
        if chunk.start != req.num_computed:
            raise ValueError(f"chunk of {req.request_id!r} starts at {chunk.start}, the request is at {req.num_computed}")
        req.num_computed += chunk.num_tokens
        full = req.num_computed // self.block_size
        if not self.pool.caching or full <= req.num_registered:
            return
        extend_hashes(req.block_hashes, req.all_token_ids, self.block_size, limit=full)
        for i in range(req.num_registered, full):
            self.pool.register(req.block_table[i], req.block_hashes[i])
        req.num_registered = full

    # ---- helpers ----------------------------------------------------------------------------
    def _admit(self, req: Request, budget: int) -> ScheduledChunk | None:
        """Takes `req`'s cache hits and blocks for its first chunk; None (nothing taken) when they do not fit."""
        hits = self._lookup(req)
        start = len(hits) * self.block_size
        n = min(req.num_tokens - start, budget)
        new = -(-(start + n) // self.block_size) - len(hits)
        revived = sum(1 for b in hits if self.pool.ref_count(b) == 0)  # cached blocks that stop being evictable
        if new > self.pool.num_free - revived:
            return None
        self.pool.acquire(hits)
        req.block_table = hits + self.pool.allocate(new)
        req.num_computed = start
        req.num_registered = len(hits)
        if self._uses_cache(req):
            self.stats.prefix_queries += req.num_tokens
            self.stats.prefix_hits += start
        if req.cached_tokens is None:
            req.cached_tokens = start
        if self.state_slots is not None:
            req.state_slot = self.state_slots.allocate(1)[0]
        return ScheduledChunk(req, start, n)

    def _uses_cache(self, req: Request) -> bool:
        """Requests asking for prompt logprobs compute every prompt position (no lookup); they still
        leave their blocks in the cache for others."""
        return self.pool.caching and not req.prompt_logprobs_pending

    def _lookup(self, req: Request) -> list[int]:
        if not self._uses_cache(req):
            return []
        limit = (req.num_tokens - 1) // self.block_size  # the last token is always computed
        hashes = extend_hashes(req.block_hashes, req.all_token_ids, self.block_size, limit=limit)
        return self.pool.lookup(hashes[:limit])

    def _new_blocks(self, req: Request, n: int) -> int:
        return -(-(req.num_computed + n) // self.block_size) - len(req.block_table)

    def _preempt(self, req: Request) -> None:
        self.stats.preemptions += 1
        self.running.remove(req)
        self._release(req)
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        self.pool.release(req.block_table)
        if req.state_slot >= 0:
            self.state_slots.release([req.state_slot])
            req.state_slot = -1
        req.block_table = []
        req.num_computed = 0
        req.num_registered = 0
