"""A scripted `moemesh.v1.Generation` server for gateway tests: answers every Generate with the
responses it is given (or a gRPC error), records requests and counts calls cancelled mid-stream."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from moemesh.rpc.config import RpcConfig
from moemesh.rpc.generation import SERVICE_NAME, pb, pb_grpc
from moemesh.rpc.security import api_key_credential
from moemesh.rpc.server import NOT_SERVING, SERVING, Service, build_server


def script(*deltas: str, finish: str = "stop", prompt_tokens: int = 7, stop_string: str = "", logprobs: bool = False) -> list:
    """One response per text delta (one token each), then the final message."""
    out = []
    for i, text in enumerate(deltas):
        r = pb.GenerateResponse(text=text, token_ids=[100 + i])
        if logprobs:
            r.logprobs.append(-0.25 * (i + 1))
            r.tokens.append(text)
            r.top_logprobs.append(pb.TopLogprobs(candidates=[pb.TokenLogprob(token_id=100 + i, token=text, logprob=-0.25 * (i + 1)),
                                                             pb.TokenLogprob(token_id=5, token="x", logprob=-3.0)]))
        if i == 0:
            r.usage.CopyFrom(pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=1))
        out.append(r)
    out.append(pb.GenerateResponse(finish_reason=finish, stop_string=stop_string,
                                   usage=pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=len(deltas))))
    return out


@dataclass
class FakeGeneration:
    responses: list = field(default_factory=lambda: script("Hello", " world"))
    error: tuple | None = None  # (grpc.StatusCode, message) raised before the first response
    delay_s: float = 0.0  # before each response
    fail_after: int | None = None  # abort with `error` after this many responses
    requests: list = field(default_factory=list)
    cancelled: int = 0
    finished: int = 0

    async def Generate(self, request, context):
        self.requests.append(request)
        if self.error is not None and self.fail_after is None:
            await context.abort(*self.error)
        done = False
        try:
            for i, resp in enumerate(self.responses):
                if self.fail_after is not None and i == self.fail_after:
                    done = True
                    await context.abort(*self.error)
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                yield resp
            done = True
            self.finished += 1
        finally:
            if not done:
                self.cancelled += 1

    async def Abort(self, request, context):
        return pb.AbortResponse(found=False)

    async def GetModelInfo(self, request, context):
        return pb.ModelInfo(name="fake-model", architecture="MixtralForCausalLM", vocab_size=1000, max_context=2048,
                            max_new_tokens_limit=2047, has_chat_template=True)

    async def CountTokens(self, request, context):
        self.requests.append(request)
        if self.error is not None:
            await context.abort(*self.error)
        return pb.TokenCount(prompt_tokens=sum(len(m.content) for m in request.messages.messages))


class FakeRouter:
    """The fake servicer on a loopback port, with health (set `serving` to flip the Generation status)."""

    def __init__(self) -> None:
        self.servicer = FakeGeneration()
        self.server = None
        self.port = 0

    async def start(self) -> str:
        # like the real router: the public API asks for the API key only (none here)
        self.server = build_server(RpcConfig(), Service(pb_grpc.add_GenerationServicer_to_server, self.servicer, SERVICE_NAME),
                                   credential=api_key_credential(""))
        self.port = self.server.bind("127.0.0.1:0")
        await self.server.start()
        return f"127.0.0.1:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        await self.server.health.set(SERVICE_NAME, SERVING if serving else NOT_SERVING)

    async def stop(self) -> None:
        await self.server.stop(0)


def status(code: str, message: str) -> tuple:
    return grpc.StatusCode[code], message
