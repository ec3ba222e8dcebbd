"""`Router`: the request path of the front door, independent of gRPC.

    prepare (validate, tokenize) -> admission slot -> replica (the one holding the prompt's prefix,
    else the least loaded; the next one if it is unavailable before the first token) -> stream its
    tokens through the detokenizer and stop strings -> final message

Leaving the stream early (client cancel, deadline, stop string) closes the replica's stream, which
aborts the sequence there and frees its KV blocks.
"""
from __future__ import annotations

from contextlib import aclosing
from typing import AsyncIterator

import grpc

from moemesh.block_hash import block_hashes
from moemesh.contracts.info import ModelInfo
from moemesh.errors import MeshError
from router_svc.admission import Admission
from router_svc.output import OutputAssembler
from router_svc.prepare import RequestPreparer
from router_svc.replicas import ReplicaSet
from router_svc.types import Delta, Finished, GenerationInput, SequenceSpec, SequenceUpdate


class Router:
    def __init__(self, info: ModelInfo, replicas: ReplicaSet, admission: Admission, tokenizer=None) -> None:
        self.info = info
        self.replicas = replicas
        self.admission = admission
        self.tokenizer = tokenizer
        self.preparer = RequestPreparer(info, tokenizer)
        self._placed: dict[str, object] = {}  # request id -> replica running it
        self._callers: dict[str, str] = {}  # request id -> who started it (only they may abort it)

    async def generate(self, req: GenerationInput, timeout: float | None = None, caller: str = "") -> AsyncIterator[Delta | Finished]:
        """caller: who sends the request (`moemesh.rpc.security.caller_identity`); `abort` honours only them."""
        spec = self.preparer.prepare(req)
        async with self.admission.slot():
            if spec.request_id in self._placed or spec.request_id in self._callers:
                raise MeshError(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {spec.request_id!r} is already running")
            self._callers[spec.request_id] = caller
            try:
                wants_texts = spec.sampling.logprobs or spec.sampling.top_logprobs > 0
                out = OutputAssembler(spec.prompt_token_ids, req.stop, self.tokenizer, token_texts=wants_texts)
                finish = ""
                async with aclosing(self._updates(spec, timeout)) as updates:
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
                self._placed.pop(spec.request_id, None)
                self._callers.pop(spec.request_id, None)

    async def _updates(self, spec: SequenceSpec, timeout: float | None) -> AsyncIterator[SequenceUpdate]:
        """The sequence's updates from the replica `ReplicaSet.pick` chooses for its prompt. A replica that
        is UNAVAILABLE before its first update (draining, down) is marked so and the next one is tried."""
        tried: set[str] = set()
        prefix = self._prefix_keys(spec)
        while True:
            replica = self.replicas.pick(exclude=tried, prefix=prefix)
            self._placed[spec.request_id] = replica
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

    def count_tokens(self, req: GenerationInput) -> int:
        """How many prompt tokens `req`'s input makes, as `generate` would tokenize it."""
        return self.preparer.count(req)

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
        False if unknown, or started by another caller (to them it is as if it did not exist)."""
        replica = self._placed.get(request_id)
        if replica is None or self._callers.get(request_id) != caller:
            return False
        return await replica.client.abort(request_id)
