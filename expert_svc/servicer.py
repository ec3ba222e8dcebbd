"""`ExpertServicer`: moemesh.v1.ExpertService <-> `ExpertShard`. Translation and status codes only."""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable

import grpc
import torch

from expert_svc.dist_hub import CLIENT_RANK, DistHub
from expert_svc.errors import BadForward, CallFailed, OverBudget, UnknownExperts
from expert_svc.shard import ExpertShard
from moemesh.errors import MeshError
from moemesh.rpc.protos import load
from moemesh.telemetry.gpu import UNAVAILABLE, GpuTelemetry
from moemesh.transport.codec import CodecError, decode, encode
from moemesh.transport.dist_frames import ForwardCall

SERVICE_NAME = "moemesh.v1.ExpertService"
expert_pb2, expert_grpc = load("expert")
log = logging.getLogger(__name__)

STATUS = {
    UnknownExperts: grpc.StatusCode.FAILED_PRECONDITION,
    BadForward: grpc.StatusCode.INVALID_ARGUMENT,
    CodecError: grpc.StatusCode.INVALID_ARGUMENT,
    OverBudget: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def status_of(e: Exception) -> grpc.StatusCode | None:
    for cls, code in STATUS.items():
        if isinstance(e, cls):
            return code
    return None


def failure_of(e: Exception, what: str) -> CallFailed:
    """A domain error as its status; anything else (e.g. an unreadable checkpoint) as INTERNAL, logged."""
    code = status_of(e)
    if code is not None:
        return CallFailed(code, str(e))
    log.error("%s failed", what, exc_info=e)
    return CallFailed(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")


def expert_set(held: dict[int, tuple[int, ...]]):
    return expert_pb2.ExpertSet(experts=[expert_pb2.LayerExperts(layer=l, expert_ids=es) for l, es in held.items()])


class ExpertServicer(expert_grpc.ExpertServiceServicer):
    def __init__(
        self, shard: ExpertShard, pool: ThreadPoolExecutor, max_message_bytes: int, dist: DistHub | None = None,
        gpu: GpuTelemetry | None = None, inline_max_elements: int = 0,
    ):
        """inline_max_elements: a gRPC Forward whose x has at most this many elements (a decode-sized
        call) is computed on the event loop itself instead of the pool (0 = never). With one compute
        thread the pool runs calls one at a time anyway, and its two thread hand-offs per call
        (loop -> pool -> loop) are a large part of a small call's latency; larger calls (prefill)
        stay on the pool so health checks and heartbeats are never held up long. The shard's layers
        are immutable snapshots, so a LoadExperts running on the pool meanwhile stays safe."""
        self.inline_max_elements = inline_max_elements
        self.gpu = gpu
        self.shard = shard
        self.pool = pool
        self.max_bytes = max_message_bytes
        self.dist = dist
        # with a control plane: `ControlAgent.check_drop`, which refuses drops of experts still placed here
        self.drop_guard: Callable[[dict[int, list[int]]], Awaitable[None]] | None = None
        if dist is not None:
            dist.serve(self.forward_dist)

    async def _call(self, fn, *args, inline: bool = False):
        """fn(*args) on the compute pool (or here, `inline`); failures raise `CallFailed` with their status."""
        try:
            if inline:
                return fn(*args)
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        except Exception as e:  # noqa: BLE001 - reported with its status; the server keeps serving
            raise failure_of(e, getattr(fn, "__name__", "call")) from None

    async def _run(self, context, fn, *args, inline: bool = False):
        """`_call`, with a failure ending the RPC with its status."""
        try:
            return await self._call(fn, *args, inline=inline)
        except CallFailed as e:
            await context.abort(e.code, e.message)

    async def _forward_rows(self, request) -> torch.Tensor:
        """y for a request carrying x (grouped rows, or tokens with weights)."""
        if not request.HasField("x"):
            raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, "x is missing")
        try:
            x = decode(request.x, field="x", max_bytes=self.max_bytes, ndim=2)
        except CodecError as e:
            raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return await self._call(self._computation(request, x), inline=x.numel() <= self.inline_max_elements)

    async def Forward(self, request, context):
        self.shard.stats.enter()
        try:
            try:
                y = await self._forward_rows(request)
            except CallFailed as e:
                await context.abort(e.code, e.message)
            return expert_pb2.ForwardResponse(y=encode(y))
        finally:
            self.shard.stats.leave()

    async def ForwardStream(self, request_iterator, context):
        """Forward calls on one stream, answered in order; a failed call answers with its status in
        the message and the stream goes on."""
        async for request in request_iterator:
            self.shard.stats.enter()
            try:
                resp = expert_pb2.ForwardResponse(call_id=request.call_id, y=encode(await self._forward_rows(request)))
            except CallFailed as e:
                resp = expert_pb2.ForwardResponse(call_id=request.call_id, error_code=e.code.value[0], error=e.message)
            finally:
                self.shard.stats.leave()
            yield resp

    def _computation(self, request, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The request's compute on x, as a call whose domain errors `_run` maps to statuses."""
        def compute() -> torch.Tensor:
            weights = decode(request.weights, field="weights", max_bytes=self.max_bytes, ndim=2) if request.HasField("weights") else None
            return self.compute(request.layer, x, list(request.expert_ids), list(request.counts), weights)

        compute.__name__ = "forward"
        return compute

    def compute(self, layer: int, x: torch.Tensor, expert_ids: list[int], counts: list[int], weights: torch.Tensor | None) -> torch.Tensor:
        """Grouped rows x [N, H] with counts [G], or (weights [T, G] set) tokens x [T, H] combined
        on the server; raises the shard's domain errors."""
        if weights is None:
            return self.shard.forward(layer, x, expert_ids, counts)
        if counts:
            raise BadForward("counts must be empty when weights is set (every expert computes every row of x)")
        return self.shard.forward_weighted(layer, x, expert_ids, weights)

    def forward_dist(self, call: ForwardCall) -> torch.Tensor:
        """One call from a dist link (on the link's thread): y, or CallFailed with the status."""
        self.shard.stats.enter()
        try:
            return self.compute(call.layer, call.x, call.expert_ids, call.counts, call.weights)
        except Exception as e:  # noqa: BLE001 - answered on the link with its status
            raise failure_of(e, "dist forward") from None
        finally:
            self.shard.stats.leave()

    async def LoadExperts(self, request, context):
        for le in request.experts:
            await self._run(context, self.shard.load, le.layer, list(le.expert_ids))
        return expert_set(self.shard.held())

    async def DropExperts(self, request, context):
        if self.drop_guard is not None:
            try:
                await self.drop_guard({le.layer: list(le.expert_ids) for le in request.experts})
            except MeshError as e:
                await context.abort(e.code, e.message)
        for le in request.experts:
            await self._run(context, self.shard.drop, le.layer, list(le.expert_ids))
        return expert_set(self.shard.held())

    async def GetStats(self, request, context):
        return stats_message(self.shard, reset=request.reset, gpu=self.gpu)

    async def OpenDistLink(self, request, context):
        if self.dist is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this server offers no torch.distributed transport (transport=grpc)")
        try:
            link_id, secret = self.dist.open(request.client_id, request.host_id)
        except ValueError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return expert_pb2.OpenDistLinkResponse(
            link_id=link_id, store_addr=self.dist.addr, backend=self.dist.backend, client_rank=CLIENT_RANK, link_secret=secret)


def gpu_message(gpu: GpuTelemetry | None):
    s = gpu.read() if gpu is not None else UNAVAILABLE
    return expert_pb2.GpuStats(
        available=s.available, name=s.name, utilization=s.utilization, memory_used_bytes=s.memory_used_bytes,
        memory_total_bytes=s.memory_total_bytes, power_watts=s.power_watts,
    )


def stats_message(shard: ExpertShard, reset: bool = False, gpu: GpuTelemetry | None = None):
    """The shard's stats as moemesh.v1.ExpertStats; `gpu` None reports no GPU."""
    snap = shard.stats.snapshot(reset=reset)
    return expert_pb2.ExpertStats(
        loads=[expert_pb2.ExpertLoad(layer=l, expert_id=e, tokens=n) for (l, e), n in sorted(snap.tokens.items())],
        queue_depth=snap.queue_depth,
        busy_seconds=snap.busy_seconds,
        requests=snap.requests,
        window_seconds=snap.window_seconds,
        held=expert_set(shard.held()),
        gpu=gpu_message(gpu),
        window_work=expert_pb2.ExpertWork(**{k: (int(v) if k in ("requests", "expert_calls", "rows") else v) for k, v in snap.work.items()},
                                          cpu_limit=snap.cpu_limit or 0.0),
    )
