"""`GenerationServicer`: moemesh.v1.Generation <-> `Router` (translation only).

Generate's requests arrive as raw bytes and are parsed here, so a string field with invalid UTF-8
gets INVALID_ARGUMENT naming the field rather than a generic deserialization failure, and a request
with more repeated entries than a valid one has is refused before it is parsed (wire_shape.py).
Prompt token ids stay in the parsed message's container (no copy on the event loop): the router
counts them, then checks and converts them on a worker thread; the other repeated fields are small
once the wire check has passed.
"""
from __future__ import annotations

import uuid

import grpc
from google.protobuf.message import DecodeError

from moemesh.contracts.info import ModelInfo
from moemesh.errors import MeshError, invalid
from moemesh.rpc.generation import SERVICE_NAME  # the public API, named once beside its client (gateway, CLI)
from moemesh.rpc.protos import load
from moemesh.rpc.security import caller_identity
from router_svc.router import Router
from router_svc.prepare import (MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TEMPLATE_KWARGS, MAX_TOOL_CALLS,
                                MAX_TOOLS)
from router_svc.types import ChatTurn, Delta, GenerationInput, SamplingSpec, ToolCallSpec, ToolSpec
from router_svc.utf8 import find_bad_utf8
from router_svc.wire_shape import WireLimits, check_wire_shape

pb, pb_grpc = load("generation")


def parse_request(raw: bytes):
    try:
        return pb.GenerateRequest.FromString(raw)
    except DecodeError as exc:
        try:
            field = find_bad_utf8(pb.GenerateRequest.DESCRIPTOR, raw)
        except ValueError:
            field = None
        if field:
            raise invalid(f"{field}: not valid UTF-8") from exc
        raise invalid(f"request: not a valid GenerateRequest ({exc})") from exc


def _opt(msg, name: str):
    return getattr(msg, name) if msg.HasField(name) else None


def to_input(req) -> GenerationInput:
    which = req.WhichOneof("input")
    sampling = SamplingSpec(
        max_new_tokens=_opt(req, "max_new_tokens"),
        temperature=_opt(req, "temperature"),
        top_p=_opt(req, "top_p"),
        top_k=_opt(req, "top_k"),
        seed=_opt(req, "seed"),
        stop_token_ids=req.stop_token_ids,
        logprobs=req.logprobs,
        prompt_logprobs=req.prompt_logprobs,
        ignore_eos=req.ignore_eos,
        top_logprobs=req.top_logprobs,
    )
    return GenerationInput(
        request_id=req.request_id or uuid.uuid4().hex,
        model=req.model,
        prompt=req.prompt if which == "prompt" else None,
        prompt_token_ids=req.prompt_token_ids.ids if which == "prompt_token_ids" else None,  # not copied here
        messages=tuple(to_turn(m) for m in req.messages.messages) if which == "messages" else None,
        sampling=sampling,
        stop=tuple(req.stop),
        tools=tuple(ToolSpec(t.name, t.description, t.parameters) for t in req.tools),
        chat_template_kwargs=tuple(sorted(req.chat_template_kwargs.items())),
        fill_context=req.fill_context,
        continue_final_message=req.continue_final_message,
    )


def to_turn(m) -> ChatTurn:
    return ChatTurn(
        role=m.role, content=m.content, tool_calls=tuple(ToolCallSpec(c.id, c.name, c.arguments) for c in m.tool_calls),
        tool_call_id=m.tool_call_id, name=m.name, reasoning_content=m.reasoning_content,
    )


def to_response(request_id: str, item):
    if isinstance(item, Delta):
        msg = pb.GenerateResponse(
            request_id=request_id, text=item.text, token_ids=item.token_ids, logprobs=item.logprobs, tokens=item.tokens,
            top_logprobs=[
                pb.TopLogprobs(candidates=[pb.TokenLogprob(token_id=c.token_id, token=c.token, logprob=c.logprob) for c in top])
                for top in item.top_logprobs
            ],
        )
        if item.prompt_tokens is not None:
            msg.usage.CopyFrom(pb.Usage(prompt_tokens=item.prompt_tokens, completion_tokens=item.completion_tokens,
                                        cached_tokens=item.cached_tokens))
        return msg
    return pb.GenerateResponse(
        request_id=request_id,
        finish_reason=item.finish_reason,
        usage=pb.Usage(prompt_tokens=len(item.prompt_token_ids), completion_tokens=item.completion_tokens,
                       cached_tokens=item.cached_tokens),
        prompt_token_ids=item.prompt_token_ids,
        prompt_logprobs=[pb.PromptLogprob(logprob=lp) for lp in item.prompt_logprobs],
        stop_string=item.stop_string,
    )


def info_to_proto(info: ModelInfo):
    return pb.ModelInfo(
        name=info.name,
        architecture=info.architecture,
        vocab_size=info.vocab_size,
        max_context=info.max_context,
        max_new_tokens_limit=info.max_new_tokens_limit,
        eos_token_ids=info.eos_token_ids,
        has_chat_template=info.has_chat_template,
        num_experts=info.num_experts,
        experts_per_token=info.experts_per_token,
        num_layers=info.num_layers,
    )


class GenerationServicer:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.wire_limits = WireLimits(router.limits.max_messages, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOOLS,
                                      MAX_TEMPLATE_KWARGS, MAX_TOOL_CALLS)

    def _input(self, raw: bytes) -> GenerationInput:
        check_wire_shape(raw, self.wire_limits)
        return to_input(parse_request(raw))

    async def Generate(self, raw: bytes, context: grpc.aio.ServicerContext):
        try:
            inp = self._input(raw)
            async for item in self.router.generate(inp, timeout=context.time_remaining(), caller=caller_identity(context)):
                yield to_response(inp.request_id, item)
        except MeshError as exc:
            await context.abort(exc.code, exc.message)

    async def Abort(self, request, context: grpc.aio.ServicerContext):
        try:
            found = await self.router.abort(request.request_id, caller=caller_identity(context))
        except MeshError as exc:
            await context.abort(exc.code, exc.message)
        return pb.AbortResponse(found=found)

    async def GetModelInfo(self, request, context: grpc.aio.ServicerContext):
        return info_to_proto(self.router.info)

    async def CountTokens(self, raw: bytes, context: grpc.aio.ServicerContext):
        try:
            return pb.TokenCount(prompt_tokens=await self.router.count_tokens(self._input(raw)))
        except MeshError as exc:
            await context.abort(exc.code, exc.message)


def add_to_server(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """Like the generated `add_GenerationServicer_to_server`, but Generate and CountTokens receive raw bytes."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=None,
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort,
            request_deserializer=pb.AbortRequest.FromString,
            response_serializer=pb.AbortResponse.SerializeToString,
        ),
        "CountTokens": grpc.unary_unary_rpc_method_handler(
            servicer.CountTokens,
            request_deserializer=None,
            response_serializer=pb.TokenCount.SerializeToString,
        ),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo,
            request_deserializer=pb.GetModelInfoRequest.FromString,
            response_serializer=pb.ModelInfo.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
