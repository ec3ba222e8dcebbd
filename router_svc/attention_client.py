"""`AttentionClient`: the router's gRPC client of one attention replica (protos <-> domain).

An upstream error becomes a `RequestError` with the replica's status and message, so a client sees
e.g. the replica's INVALID_ARGUMENT unchanged. Closing the `generate` stream cancels the call.
"""
from __future__ import annotations

from typing import AsyncIterator

import grpc

from moemesh.rpc.config import RpcConfig
from moemesh.rpc.protos import load
from moemesh.rpc.server import make_channel
from router_svc.errors import RequestError
from router_svc.types import LoadReport, ModelInfo, SequenceSpec, SequenceUpdate

pb, pb_grpc = load("attention")


def _upstream(exc: grpc.aio.AioRpcError) -> RequestError:
    return RequestError(exc.code().name, exc.details() or f"attention replica failed with {exc.code().name}")


def to_proto(spec: SequenceSpec):
    s = spec.sampling
    return pb.SequenceRequest(
        request_id=spec.request_id,
        prompt_token_ids=spec.prompt_token_ids,
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        stop_token_ids=s.stop_token_ids,
        logprobs=s.logprobs,
        prompt_logprobs=s.prompt_logprobs,
        ignore_eos=s.ignore_eos,
    )


def from_proto(msg) -> SequenceUpdate:
    return SequenceUpdate(
        token_ids=tuple(msg.token_ids),
        logprobs=tuple(msg.logprobs),
        finish_reason=msg.finish_reason,
        prompt_logprobs=tuple(p.logprob if p.HasField("logprob") else None for p in msg.prompt_logprobs),
        cached_tokens=msg.cached_tokens if msg.HasField("cached_tokens") else None,
    )


class AttentionClient:
    def __init__(self, address: str, rpc: RpcConfig) -> None:
        self.address = address
        self.channel = make_channel(address, rpc)
        self.stub = pb_grpc.AttentionStub(self.channel)

    async def generate(self, spec: SequenceSpec, timeout: float | None) -> AsyncIterator[SequenceUpdate]:
        call = self.stub.Generate(to_proto(spec), timeout=timeout)
        try:
            async for msg in call:
                yield from_proto(msg)
        except grpc.aio.AioRpcError as exc:
            raise _upstream(exc) from exc
        finally:
            call.cancel()

    async def abort(self, request_id: str) -> bool:
        try:
            resp = await self.stub.Abort(pb.AbortSequenceRequest(request_id=request_id), timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise _upstream(exc) from exc
        return resp.found

    async def get_load(self, timeout: float) -> LoadReport:
        r = await self.stub.GetLoad(pb.GetLoadRequest(), timeout=timeout)
        return LoadReport(r.waiting, r.running, r.free_blocks, r.total_blocks, r.serving, r.accepted)

    async def get_info(self, timeout: float, name: str = "") -> tuple[ModelInfo, str]:
        """The replica's model limits (named `name`, default the model directory's name) and model dir."""
        r = await self.stub.GetReplicaInfo(pb.GetReplicaInfoRequest(), timeout=timeout, wait_for_ready=True)
        from pathlib import Path

        info = ModelInfo(
            name=name or Path(r.model_dir).name,
            architecture=r.architecture,
            vocab_size=r.vocab_size,
            max_context=r.max_context,
            max_new_tokens_limit=r.max_new_tokens_limit,
            eos_token_ids=tuple(r.eos_token_ids),
            num_experts=r.num_experts,
            experts_per_token=r.experts_per_token,
            num_layers=r.num_layers,
            kv_block_size=r.kv_block_size,
            prefix_caching=r.prefix_caching,
        )
        return info, r.model_dir

    async def close(self) -> None:
        await self.channel.close()
