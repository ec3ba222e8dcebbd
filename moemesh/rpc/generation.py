"""Clients of the public `moemesh.v1.Generation` service (the router), shared by `moemesh generate`,
`demo`, `bench` and the HTTP gateway.

`build_request(...)` makes a GenerateRequest; `Completion` accumulates a response stream into the
JSON object `moemesh run --json` prints; `GenerationClient` is the asyncio client (a failed call
raises `MeshError` with the router's status and message; leaving a `generate` stream early cancels
the call, which aborts the sequence on its attention replica).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moemesh.errors import from_rpc_error
from moemesh.rpc.config import RpcConfig
from moemesh.rpc.protos import load
from moemesh.rpc.server import make_channel

pb, pb_grpc = load("generation")
SERVICE_NAME = "moemesh.v1.Generation"


def build_request(
    *,
    prompt: str | None = None,
    prompt_token_ids=None,
    messages=None,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop=(),
    logprobs: bool = False,
    prompt_logprobs: bool = False,
    ignore_eos: bool = False,
    top_logprobs: int = 0,
    request_id: str = "",
    model: str = "",
):
    """A GenerateRequest; exactly one of prompt / prompt_token_ids / messages ([(role, content)])."""
    req = pb.GenerateRequest(
        request_id=request_id, model=model, max_new_tokens=max_new_tokens, temperature=temperature,
        top_p=top_p, top_k=top_k, seed=seed, stop=list(stop), logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, ignore_eos=ignore_eos, top_logprobs=top_logprobs,
    )
    if prompt_token_ids is not None:
        req.prompt_token_ids.ids.extend(prompt_token_ids)
    elif messages is not None:
        req.messages.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in messages)
    else:
        req.prompt = prompt if prompt is not None else ""
    return req


@dataclass
class Completion:
    """One request's stream, accumulated."""

    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None

    def add(self, resp) -> str:
        """Adds one GenerateResponse; returns its text delta."""
        self.token_ids.extend(resp.token_ids)
        self.logprobs.extend(resp.logprobs)
        self.text += resp.text
        if resp.finish_reason:
            self.finish_reason = resp.finish_reason
            self.prompt_token_ids = list(resp.prompt_token_ids)
            if resp.prompt_logprobs:
                self.prompt_logprobs = [p.logprob if p.HasField("logprob") else None for p in resp.prompt_logprobs]
        return resp.text

    def to_json(self) -> dict:
        """The object `moemesh run --json` prints."""
        return {
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "logprobs": self.logprobs,
            "prompt_logprobs": self.prompt_logprobs,
        }


class GenerationClient:
    """The router's Generation service over one asyncio channel (build it on the loop that uses it)."""

    def __init__(self, address: str, rpc: RpcConfig | None = None, api_key: str = "") -> None:
        """api_key: sent as `authorization: Bearer KEY` (a router started with --api-key asks for it)."""
        self.address = address
        self.channel = make_channel(address, rpc or RpcConfig(), api_key=api_key)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def generate(self, req, timeout: float | None = None) -> AsyncIterator:
        """The GenerateResponse messages of `req`; closing the iterator early cancels the call."""
        call = self.stub.Generate(req, timeout=timeout)
        try:
            async for resp in call:
                yield resp
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc
        finally:
            call.cancel()

    async def model_info(self, timeout: float | None = None, wait_for_ready: bool = False):
        return await self._unary(self.stub.GetModelInfo, pb.GetModelInfoRequest(), timeout, wait_for_ready)

    async def count_tokens(self, req, timeout: float | None = None) -> int:
        return (await self._unary(self.stub.CountTokens, req, timeout)).prompt_tokens

    async def abort(self, request_id: str, timeout: float | None = None) -> bool:
        return (await self._unary(self.stub.Abort, pb.AbortRequest(request_id=request_id), timeout)).found

    async def serving(self, timeout: float = 2.0) -> bool:
        """Whether the router can serve a request now: its health for the Generation service (SERVING
        only while an attention replica can take a sequence). False when it does not answer."""
        try:
            resp = await self.health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def _unary(self, method, req, timeout: float | None, wait_for_ready: bool = False):
        try:
            return await method(req, timeout=timeout, wait_for_ready=wait_for_ready)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc

    async def close(self) -> None:
        await self.channel.close()
