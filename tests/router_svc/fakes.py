"""A scripted attention replica for router tests: emits given tokens, records closes and aborts."""
from __future__ import annotations

import asyncio

import grpc

from moemesh.contracts.info import LoadReport
from moemesh.errors import MeshError
from router_svc.types import SequenceUpdate


class FakeAttention:
    def __init__(self, tokens, finish_reason="length", delay_s=0.0, prompt_logprobs=(), address="fake", cached_tokens=None):
        self.address = address
        self.tokens = list(tokens)
        self.finish_reason = finish_reason
        self.delay_s = delay_s
        self.prompt_logprobs = tuple(prompt_logprobs)
        self.cached_tokens = cached_tokens
        self.specs = []
        self.closed_early = []  # request ids whose stream was closed before finishing
        self.aborted = []
        self._abort_events: dict[str, asyncio.Event] = {}  # by sequence id
        self._client_ids: dict[str, str] = {}  # sequence id -> the client's request id

    async def generate(self, spec, timeout):
        self.specs.append(spec)
        seq = spec.sequence_id or spec.request_id  # the replica's id of the sequence
        self._client_ids[seq] = spec.request_id
        ev = self._abort_events[seq] = asyncio.Event()
        done = False
        try:
            for i, t in enumerate(self.tokens):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if ev.is_set():
                    done = True
                    yield SequenceUpdate(finish_reason="abort")
                    return
                last = i == len(self.tokens) - 1
                yield SequenceUpdate(
                    token_ids=(t,),
                    logprobs=(-0.5,),
                    finish_reason=self.finish_reason if last else "",
                    prompt_logprobs=self.prompt_logprobs if i == 0 else (),
                    cached_tokens=self.cached_tokens if i == 0 else None,
                )
            done = True
        finally:
            self._abort_events.pop(seq, None)
            if not done:
                self.closed_early.append(spec.request_id)

    async def abort(self, sequence_id):
        self.aborted.append(self._client_ids.get(sequence_id, sequence_id))  # recorded under the client's id
        ev = self._abort_events.get(sequence_id)
        if ev is None:
            return False
        ev.set()
        return True

    async def get_load(self, timeout):
        return LoadReport()


class DownAttention(FakeAttention):
    """A replica that refuses every sequence as UNAVAILABLE (draining or down)."""

    async def generate(self, spec, timeout):
        self.specs.append(spec)
        raise MeshError(grpc.StatusCode.UNAVAILABLE, "attention: this replica is shutting down")
        yield  # an async generator, like the real client
