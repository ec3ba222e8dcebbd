"""`AttentionServicer`: moemesh.v1.Attention <-> `AttentionReplica` (translation only)."""
from __future__ import annotations

import grpc

from attention_svc.errors import ReplicaError
from attention_svc.replica import AttentionReplica, SequenceRequest
from moemesh.rpc.protos import load

pb, pb_grpc = load("attention")
SERVICE_NAME = "moemesh.v1.Attention"
SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")


def to_request(msg) -> SequenceRequest:
    sampling = {name: getattr(msg, name) for name in SAMPLING_FIELDS if msg.HasField(name)}
    sampling["stop_token_ids"] = tuple(msg.stop_token_ids)
    sampling["ignore_eos"] = msg.ignore_eos
    sampling["prompt_logprobs"] = msg.prompt_logprobs
    return SequenceRequest(msg.request_id, tuple(msg.prompt_token_ids), sampling, msg.logprobs)


def to_update(out, logprobs: bool):
    msg = pb.SequenceUpdate(finish_reason=out.finish_reason or "")
    if out.token_id is not None:
        msg.token_ids.append(out.token_id)
        if logprobs:
            msg.logprobs.append(out.logprob)
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
        except ReplicaError as exc:
            await context.abort(grpc.StatusCode[exc.code], exc.message)

    async def Abort(self, request, context):
        return pb.AbortSequenceResponse(found=self.replica.abort(request.request_id))

    async def GetLoad(self, request, context):
        load = self.replica.load()
        return pb.LoadReport(
            waiting=load.waiting, running=load.running, free_blocks=load.free_blocks,
            total_blocks=load.total_blocks, serving=load.serving, accepted=load.accepted,
        )

    async def GetReplicaInfo(self, request, context):
        i = self.replica.info()
        return pb.ReplicaInfo(
            architecture=i.architecture, vocab_size=i.vocab_size, max_context=i.max_context,
            max_new_tokens_limit=i.max_new_tokens_limit, eos_token_ids=i.eos_token_ids,
            num_experts=i.num_experts, experts_per_token=i.experts_per_token, num_layers=i.num_layers,
            model_dir=i.model_dir, placement_version=i.placement_version,
            kv_block_size=i.kv_block_size, prefix_caching=i.prefix_caching,
        )
