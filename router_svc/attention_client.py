"""`AttentionClient`: the router's gRPC client of one attention replica (protos <-> domain).

An upstream error becomes a `MeshError` with the replica's status and message, so a client sees
e.g. the replica's INVALID_ARGUMENT unchanged. Closing the `generate` stream cancels the call.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import AsyncIterator

import grpc

from moemesh.contracts.info import LoadReport, ModelInfo
from moemesh.contracts.wire import load_from_proto, model_info_from_proto
from moemesh.errors import MeshError
from moemesh.rpc.config import RpcConfig
from moemesh.rpc.protos import load
from moemesh.rpc.server import make_channel
from router_svc.types import SequenceSpec, SequenceUpdate

pb, pb_grpc = load("attention")


def _upstream(exc: grpc.aio.AioRpcError) -> MeshError:
    return MeshError(exc.code(), exc.details() or f"attention replica failed with {exc.code().name}")


def to_proto(spec: SequenceSpec):
    s = spec.sampling
    return pb.SequenceRequest(
        request_id=spec.sequence_id or spec.request_id,
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
        top_logprobs=s.top_logprobs,
    )


def from_proto(msg) -> SequenceUpdate:
    return SequenceUpdate(
        token_ids=tuple(msg.token_ids),
        logprobs=tuple(msg.logprobs),
        finish_reason=msg.finish_reason,
        prompt_logprobs=tuple(p.logprob if p.HasField("logprob") else None for p in msg.prompt_logprobs),
        top_logprobs=tuple(tuple(zip(t.token_ids, t.logprobs)) for t in msg.top_logprobs),
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

    async def abort(self, sequence_id: str) -> bool:
        try:
            resp = await self.stub.Abort(pb.AbortSequenceRequest(request_id=sequence_id), timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise _upstream(exc) from exc
        return resp.found

    async def get_load(self, timeout: float) -> LoadReport:
        return load_from_proto(await self.stub.GetLoad(pb.GetLoadRequest(), timeout=timeout))

    async def get_info(self, timeout: float, name: str = "") -> ModelInfo:
        """The replica's model limits and model directory, named `name` (default the directory's name)."""
        info = model_info_from_proto(await self.stub.GetReplicaInfo(pb.GetReplicaInfoRequest(), timeout=timeout, wait_for_ready=True))
        return replace(info, name=name or Path(info.model_dir).name)

    async def close(self) -> None:
        await self.channel.close()
