"""`AttentionReplica`: one model copy's sequences, independent of gRPC.

`generate(SequenceRequest)` yields the engine's `StepOutput`s for one sequence; leaving the
iteration early (client cancelled, deadline passed) aborts the sequence, which frees its KV blocks
at the next step boundary.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import AsyncIterator, Sequence

import grpc

from attention_svc.step_loop import StepLoop
from moemesh.contracts.info import LoadReport, ModelInfo
from moemesh.engine import SamplingParams, StepOutput
from moemesh.errors import MeshError, invalid, out_of_range


@dataclass(frozen=True)
class SequenceRequest:
    """A sequence as the router sends it; `sampling` holds only the fields the client set."""

    request_id: str
    prompt_token_ids: Sequence[int]  # a tuple, or the message's repeated field (not copied)
    sampling: dict  # SamplingParams field -> value
    logprobs: bool = False


class AttentionReplica:
    def __init__(self, engine, loop: StepLoop, placement_version=lambda: 0) -> None:
        self.engine = engine
        self.loop = loop
        self.serving = True
        self._placement_version = placement_version

    def info(self) -> ModelInfo:
        cfg = self.engine.model_config
        return ModelInfo(
            architecture=cfg.architecture,
            vocab_size=cfg.vocab_size,
            max_context=self.engine.max_model_len,
            max_new_tokens_limit=self.engine.max_model_len - 1,
            eos_token_ids=tuple(cfg.eos_token_ids),
            num_experts=cfg.num_experts,
            experts_per_token=cfg.top_k,
            num_layers=cfg.num_layers,
            model_dir=str(Path(self.engine.config.model_dir).resolve()),
            placement_version=self._placement_version(),
            kv_block_size=self.engine.config.block_size,
            prefix_caching=self.engine.prefix_caching,
        )

    def load(self) -> LoadReport:
        alloc = self.engine.kv.allocator
        return LoadReport(self.loop.waiting, self.loop.running, alloc.num_free, alloc.num_blocks, self.serving, self.loop.accepted)

    def sampling_params(self, req: SequenceRequest) -> SamplingParams:
        """The client's fields over the engine's defaults; an unset max_new_tokens is capped by the context."""
        if not req.prompt_token_ids:
            raise invalid("prompt_token_ids: must not be empty")
        room = self.engine.max_model_len - len(req.prompt_token_ids)
        if room < 1:
            raise out_of_range(
                f"prompt_token_ids: {len(req.prompt_token_ids)} tokens leave no room in the context of {self.engine.max_model_len}",
            )
        try:
            params = SamplingParams(**req.sampling)
        except ValueError as exc:
            raise invalid(str(exc)) from exc
        if "max_new_tokens" not in req.sampling:
            params = replace(params, max_new_tokens=min(params.max_new_tokens, room))
        elif params.max_new_tokens > room:
            raise out_of_range(
                f"max_new_tokens: prompt ({len(req.prompt_token_ids)}) + max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the context of {self.engine.max_model_len}",
            )
        return params

    async def generate(self, req: SequenceRequest) -> AsyncIterator[StepOutput]:
        if not self.serving:
            raise MeshError(grpc.StatusCode.UNAVAILABLE, "attention: this replica is shutting down")
        params = self.sampling_params(req)
        queue = self.loop.add(req.request_id, req.prompt_token_ids, params)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.loop.abort(req.request_id)

    def abort(self, request_id: str) -> bool:
        return self.loop.abort(request_id)
