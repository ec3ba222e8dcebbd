"""Continuous batching: each step runs one decode token for every running request plus as many
waiting prompts (whole prefills) as the free KV blocks and the token budget allow.

When a running request needs a new block and none is free, the most recently admitted request is
preempted: its blocks are freed and it goes back to the head of the queue, to be recomputed (its
generated tokens are kept and re-prefilled with the prompt).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from moemesh.engine.kv_cache import BlockAllocator
from moemesh.engine.request import Request


@dataclass(frozen=True)
class ScheduledBatch:
    """decodes: running requests that run their last token; prefills: requests (re)computed from scratch."""

    decodes: tuple[Request, ...]
    prefills: tuple[Request, ...]

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_num_seqs: int, max_num_batched_tokens: int):
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

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
        """Drop a finished or aborted request and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)

    def _release(self, req: Request) -> None:
        self.allocator.free(req.block_table)
        req.block_table = []
        req.num_cached = 0

    def _blocks_needed(self, req: Request) -> int:
        return -(-req.num_tokens // self.block_size) - len(req.block_table)

    def schedule(self) -> ScheduledBatch:
        decodes: list[Request] = []
        for req in list(self.running):
            if req not in self.running:  # preempted below while making room
                continue
            while self._blocks_needed(req) > self.allocator.num_free:
                victim = self.running[-1]
                self.running.remove(victim)
                self._release(victim)
                self.waiting.appendleft(victim)
                if victim is req:
                    break
            if req in self.running:
                req.block_table += self.allocator.allocate(self._blocks_needed(req))
                decodes.append(req)
        budget = self.max_num_batched_tokens - len(decodes)
        prefills: list[Request] = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            need = self._blocks_needed(req)
            if req.num_tokens > budget or need > self.allocator.num_free:
                break
            self.waiting.popleft()
            req.block_table += self.allocator.allocate(need)
            budget -= req.num_tokens
            self.running.append(req)
            prefills.append(req)
        return ScheduledBatch(tuple(decodes), tuple(prefills))
