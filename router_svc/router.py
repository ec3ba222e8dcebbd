"""`Router`: the request path of the front door, independent of gRPC.

    prepare (validate, tokenize) -> admission slot -> least-loaded replica -> stream its tokens
    through the detokenizer and stop strings -> final message

Leaving the stream early (client cancel, deadline, stop string) closes the replica's stream, which
aborts the sequence there and frees its KV blocks.
"""
from __future__ import annotations

from contextlib import aclosing
from typing import AsyncIterator

from router_svc.admission import Admission
from router_svc.errors import RequestError
from router_svc.output import OutputAssembler
from router_svc.prepare import RequestPreparer
from router_svc.replicas import ReplicaSet
from router_svc.types import Delta, Finished, GenerationInput, ModelInfo


class Router:
    def __init__(self, info: ModelInfo, replicas: ReplicaSet, admission: Admission, tokenizer=None) -> None:
        self.info = info
        self.replicas = replicas
        self.admission = admission
        self.tokenizer = tokenizer
        self.preparer = RequestPreparer(info, tokenizer)
        self._placed: dict[str, object] = {}  # request id -> replica running it

    async def generate(self, req: GenerationInput, timeout: float | None = None) -> AsyncIterator[Delta | Finished]:
        spec = self.preparer.prepare(req)
        async with self.admission.slot():
            if spec.request_id in self._placed:
                raise RequestError("ALREADY_EXISTS", f"request_id: {spec.request_id!r} is already running")
            replica = self.replicas.pick()
            self._placed[spec.request_id] = replica
            try:
                with self.replicas.track(replica):
                    out = OutputAssembler(spec.prompt_token_ids, req.stop, self.tokenizer)
                    finish = ""
                    async with aclosing(replica.client.generate(spec, timeout)) as updates:
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
                        raise RequestError("UNAVAILABLE", f"attention: replica {replica.address} ended the stream early")
                    tail = out.tail()
                    if tail:
                        yield Delta(text=tail, token_ids=())
                    yield out.finish(finish)
            finally:
                del self._placed[spec.request_id]

    async def abort(self, request_id: str) -> bool:
        """Stops a running request; its stream ends with finish_reason "abort". False if unknown."""
        replica = self._placed.get(request_id)
        if replica is None:
            return False
        return await replica.client.abort(request_id)
