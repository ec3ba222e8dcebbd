"""`AttentionServicer`: moemesh.v1.Attention <-> `AttentionReplica` (translation only)."""
from __future__ import annotations

import grpc

from attention_svc.replica import AttentionReplica, SequenceRequest
from moemesh.contracts.wire import load_to_proto, model_info_to_proto
from moemesh.errors import MeshError
from moemesh.rpc.protos import load

SERVICE_NAME = "moemesh.v1.Attention"
pb, pb_grpc = load("attention")
SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")


def to_request(msg) -> SequenceRequest:
    sampling = {name: getattr(msg, name) for name in SAMPLING_FIELDS if msg.HasField(name)}
    sampling["stop_token_ids"] = tuple(msg.stop_token_ids)
    sampling["ignore_eos"] = msg.ignore_eos
    sampling["prompt_logprobs"] = msg.prompt_logprobs
    if msg.top_logprobs:
        sampling["top_logprobs"] = msg.top_logprobs
    # the ids stay in the message's container: the replica checks their number before anything copies them
    return SequenceRequest(msg.request_id, msg.prompt_token_ids, sampling, msg.logprobs)


def to_update(out, logprobs: bool):
    msg = pb.SequenceUpdate(finish_reason=out.finish_reason or "")
    if out.token_id is not None:
        msg.token_ids.append(out.token_id)
        if logprobs:
            msg.logprobs.append(out.logprob)
        if out.top_logprobs is not None:
            msg.top_logprobs.append(pb.SequenceTopLogprobs(
                token_ids=[t for t, _ in out.top_logprobs], logprobs=[lp for _, lp in out.top_logprobs]))
    if out.prompt_logprobs is not None:
        msg.prompt_logprobs.extend(pb.SequencePromptLogprob(logprob=lp) for lp in out.prompt_logprobs)
    if out.cached_tokens is not None:
        msg.cached_tokens = out.cached_tokens
    return msg


class AttentionServicer(pb_grpc.AttentionServicer):
    def __init__(self, replica: AttentionReplica) -> None:
        self.replica = replica

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        try:
            req = to_request(request)
            async for out in self.replica.generate(req):
                yield to_update(out, req.logprobs)
        except MeshError as exc:
            await context.abort(exc.code, exc.message)

    async def Abort(self, request, context):
        return pb.AbortSequenceResponse(found=self.replica.abort(request.request_id))

    async def GetLoad(self, request, context):
        return load_to_proto(self.replica.load())

    async def GetReplicaInfo(self, request, context):
        return model_info_to_proto(self.replica.info())
