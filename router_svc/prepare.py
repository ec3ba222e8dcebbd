"""`RequestPreparer`: validates a client request against the model and turns it into token ids.

Every rejection names the field: `INVALID_ARGUMENT` for malformed values, `OUT_OF_RANGE` for values
beyond the model's limits, `NOT_FOUND` for an unknown model name, `FAILED_PRECONDITION` when the
model lacks what the request needs (a tokenizer for text, a chat template for messages).
"""
from __future__ import annotations

import math
import uuid
from dataclasses import replace

import grpc

from moemesh.contracts.info import ModelInfo
from moemesh.errors import MeshError, invalid, out_of_range
from router_svc.types import GenerationInput, SamplingSpec, SequenceSpec

MAX_REQUEST_ID_LEN = 256
MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 256


class RequestPreparer:
    """`prepare(GenerationInput) -> SequenceSpec`, raising `MeshError` on bad input.

    `tokenizer` may be None (a model directory without tokenizer.json): then only token ids work.
    """

    def __init__(self, info: ModelInfo, tokenizer=None) -> None:
        self.info = info
        self.tokenizer = tokenizer

    def prepare(self, req: GenerationInput) -> SequenceSpec:
        self._check_model(req.model)
        request_id = self._request_id(req.request_id)
        ids = self._prompt_ids(req)
        self._check_sampling(req.sampling, len(ids))
        self._check_stops(req.stop)
        return SequenceSpec(request_id=request_id, prompt_token_ids=ids, sampling=self._with_eos(req.sampling))

    def _with_eos(self, s: SamplingSpec) -> SamplingSpec:
        """The tokenizer's EOS ids stop generation too (as in `moemesh run`), unless ignore_eos."""
        if self.tokenizer is None or s.ignore_eos:
            return s
        extra = tuple(t for t in self.tokenizer.eos_token_ids if t not in s.stop_token_ids)
        return replace(s, stop_token_ids=s.stop_token_ids + extra) if extra else s

    def _check_model(self, model: str) -> None:
        if model and model != self.info.name:
            raise MeshError(grpc.StatusCode.NOT_FOUND, f"model: unknown model {model!r} (this mesh serves {self.info.name!r})")

    def _request_id(self, request_id: str) -> str:
        if len(request_id) > MAX_REQUEST_ID_LEN:
            raise invalid(f"request_id: at most {MAX_REQUEST_ID_LEN} characters, got {len(request_id)}")
        return request_id or uuid.uuid4().hex

    def _prompt_ids(self, req: GenerationInput) -> tuple[int, ...]:
        if req.prompt_token_ids is not None:
            ids = tuple(req.prompt_token_ids)
            field = "prompt_token_ids"
            if not ids:
                raise invalid("prompt_token_ids: must not be empty")
            self._check_token_ids(field, ids)
        elif req.messages is not None:
            ids = self._chat_ids(req.messages)
            field = "messages"
        elif req.prompt is not None:
            if not req.prompt:
                raise invalid("prompt: must not be empty")
            ids = tuple(self._require_tokenizer("prompt").encode(req.prompt))
            field = "prompt"
            if not ids:
                raise invalid("prompt: encodes to no tokens")
        else:
            raise invalid("prompt: one of prompt, prompt_token_ids or messages is required")
        if len(ids) >= self.info.max_context:
            raise out_of_range(
                f"{field}: {len(ids)} tokens leave no room in the model's context of {self.info.max_context} tokens"
            )
        return ids

    def _chat_ids(self, messages) -> tuple[int, ...]:
        if not messages:
            raise invalid("messages: must not be empty")
        for i, m in enumerate(messages):
            if not m.role:
                raise invalid(f"messages[{i}].role: must not be empty")
        tok = self._require_tokenizer("messages")
        if not tok.has_chat_template:
            raise MeshError(grpc.StatusCode.FAILED_PRECONDITION, "messages: this model has no chat template; send prompt instead")
        try:
            text = tok.apply_chat_template([{"role": m.role, "content": m.content} for m in messages])
        except Exception as exc:  # a template may raise on roles it does not support
            raise invalid(f"messages: the chat template rejected them ({exc})") from exc
        return tuple(tok.encode(text, add_special_tokens=False))

    def _require_tokenizer(self, field: str):
        if self.tokenizer is None:
            raise MeshError(grpc.StatusCode.FAILED_PRECONDITION, f"{field}: this model has no tokenizer; send prompt_token_ids")
        return self.tokenizer

    def _check_token_ids(self, field: str, ids: tuple[int, ...]) -> None:
        for i, t in enumerate(ids):
            if not 0 <= t < self.info.vocab_size:
                raise invalid(f"{field}[{i}]: {t} is not a token id (vocabulary size {self.info.vocab_size})")

    def _check_sampling(self, s: SamplingSpec, prompt_len: int) -> None:
        if s.max_new_tokens is not None:
            if s.max_new_tokens < 1:
                raise invalid(f"max_new_tokens: must be >= 1, got {s.max_new_tokens}")
            if s.max_new_tokens > self.info.max_new_tokens_limit:
                raise out_of_range(
                    f"max_new_tokens: {s.max_new_tokens} is beyond the limit of {self.info.max_new_tokens_limit}"
                )
            if prompt_len + s.max_new_tokens > self.info.max_context:
                raise out_of_range(
                    f"max_new_tokens: prompt ({prompt_len}) + max_new_tokens ({s.max_new_tokens}) exceeds "
                    f"the model's context of {self.info.max_context} tokens"
                )
        if s.temperature is not None and not (math.isfinite(s.temperature) and s.temperature >= 0):
            raise invalid(f"temperature: must be a finite number >= 0 (0 = greedy), got {s.temperature}")
        if s.top_p is not None and not (0 < s.top_p <= 1):
            raise invalid(f"top_p: must be in (0, 1], got {s.top_p}")
        if s.top_k is not None and s.top_k < 0:
            raise invalid(f"top_k: must be >= 0 (0 = off), got {s.top_k}")
        if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise invalid(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}, got {len(s.stop_token_ids)}")
        self._check_token_ids("stop_token_ids", s.stop_token_ids)

    def _check_stops(self, stops: tuple[str, ...]) -> None:
        if len(stops) > MAX_STOP_STRINGS:
            raise invalid(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        for i, s in enumerate(stops):
            if not s:
                raise invalid(f"stop[{i}]: must not be empty")
