"""`Router`: the request path of the front door, independent of gRPC.

    prepare (validate, tokenize; on a worker thread) -> admission slot -> replica (the one holding the prompt's prefix,
    else the least loaded; the next one if it is unavailable before the first token) -> stream its
    tokens through the detokenizer and stop strings -> final message

Leaving the stream early (client cancel, deadline, stop string) closes the replica's stream, which
aborts the sequence there and frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

import grpc

from moemesh.block_hash import block_hashes
from moemesh.contracts.info import ModelInfo
from moemesh.errors import MeshError
from router_svc.admission import Admission
from router_svc.limits import RequestLimits
from router_svc.output import OutputAssembler
from router_svc.prepare import RequestPreparer
from router_svc.replicas import ReplicaSet
from router_svc.types import Delta, Finished, GenerationInput, SequenceSpec, SequenceUpdate

DUPLICATE_GRACE_S = 0.5  # how long a new call waits for a cancelled stream under its id to end


class Router:
    def __init__(self, info: ModelInfo, replicas: ReplicaSet, admission: Admission, tokenizer=None) -> None:
        self.info = info
        self.replicas = replicas
        self.admission = admission
        self.tokenizer = tokenizer
        self.preparer = RequestPreparer(info, tokenizer)
        self._placed: dict[str, _Running] = {}  # request id -> where it runs and who started it

    @property
    def limits(self) -> RequestLimits:
        return self.preparer.limits

    async def generate(self, req: GenerationInput, timeout: float | None = None, caller: str = "") -> AsyncIterator[Delta | Finished]:
        """caller: who sends the request (`moemesh.rpc.security.caller_identity`); `abort` honours only them."""
        # on a worker thread: tokenizing a long prompt (without the GIL) must not hold up other streams
        spec = await asyncio.to_thread(self.preparer.prepare, req)
        async with self.admission.slot():
            await self._wait_for_id(spec.request_id)
            running = self._placed[spec.request_id] = _Running(caller=caller)
            spec = replace(spec, sequence_id=f"{spec.request_id}#{uuid.uuid4().hex[:12]}")
            try:
                wants_texts = spec.sampling.logprobs or spec.sampling.top_logprobs > 0
                out = OutputAssembler(spec.prompt_token_ids, req.stop, self.tokenizer, token_texts=wants_texts)
                finish = ""
                async with aclosing(self._updates(spec, timeout, running)) as updates:
                    async for update in updates:
                        delta = out.push(update)
                        if delta is not None:
                            yield delta
                        if out.stopped:
                            finish = "stop"
                            break
                        if update.finish_reason:
                            finish = update.finish_reason
                            break
                if not finish:
                    raise MeshError(grpc.StatusCode.UNAVAILABLE, "attention: the replica ended the stream early")
                tail = out.tail()
                if tail:
                    yield Delta(text=tail, token_ids=())
                yield out.finish(finish)
            finally:
                running.ended.set()
                if self._placed.get(spec.request_id) is running:  # an abort may have freed the id for another
                    del self._placed[spec.request_id]

    async def _wait_for_id(self, request_id: str) -> None:
        """Raises ALREADY_EXISTS while another stream runs under `request_id`. A stream whose client
        cancelled it ends within a turn or two of the event loop, but its cancellation and a new
        call reusing the id may be processed in either order: a stream still there gets
        DUPLICATE_GRACE_S to end first."""
        running = self._placed.get(request_id)
        if running is None:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(running.ended.wait(), DUPLICATE_GRACE_S)
        if request_id in self._placed:
            raise MeshError(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {request_id!r} is already running")

    async def _updates(self, spec: SequenceSpec, timeout: float | None, running: _Running) -> AsyncIterator[SequenceUpdate]:
        """The sequence's updates from the replica `ReplicaSet.pick` chooses for its prompt. A replica that
        is UNAVAILABLE before its first update (draining, down) is marked so and the next one is tried."""
        tried: set[str] = set()
        prefix = self._prefix_keys(spec)
        while True:
            replica = running.replica = self.replicas.pick(exclude=tried, prefix=prefix)
            running.sequence_id = spec.sequence_id
            started = False
            try:
                with self.replicas.track(replica):
                    async with aclosing(replica.client.generate(spec, timeout)) as updates:
                        async for update in updates:
                            started = True
                            yield update
                return
            except MeshError as exc:
                if started or exc.code != grpc.StatusCode.UNAVAILABLE:
                    raise
                self.replicas.mark_unavailable(replica)
                tried.add(replica.address)

    async def count_tokens(self, req: GenerationInput) -> int:
        """How many prompt tokens `req`'s input makes, as `generate` would tokenize it (on a worker thread)."""
        return await asyncio.to_thread(self.preparer.count, req)

    @property
    def serving(self) -> bool:
        """Whether an attention replica can take a sequence now."""
        return any(r.available for r in self.replicas.replicas)
    def _prefix_keys(self, spec: SequenceSpec) -> list:
        """The keys of the prompt's full KV blocks, when the replicas cache prefixes and routing uses them."""
        info = self.info
        if self.replicas.prefix_imbalance is None or not info.prefix_caching or info.kv_block_size < 1:
            return []
        return block_hashes(spec.prompt_token_ids, info.kv_block_size)

    async def abort(self, request_id: str, caller: str = "") -> bool:
        """Stops a running request `caller` started; its stream ends with finish_reason "abort".
        False if unknown, or started by another caller (to them it is as if it did not exist).
        Once it returns, the id is free for a new request (the replica frees it on its Abort)."""
        running = self._placed.get(request_id)
        if running is None or running.replica is None or running.caller != caller:
            return False
        found = await running.replica.client.abort(running.sequence_id)
        if self._placed.get(request_id) is running:
            del self._placed[request_id]
        return found


@dataclass(eq=False)
class _Running:
    """One request the router is serving: who started it, the replica it runs on (None until one is
    picked), its id there, and `ended` once its stream is over."""

    caller: str = ""
    replica: object | None = None
    sequence_id: str = ""
    ended: asyncio.Event = field(default_factory=asyncio.Event)
