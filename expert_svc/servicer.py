"""`ExpertServicer`: moemesh.v1.ExpertService <-> `ExpertShard`. Translation and status codes only."""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import grpc
import torch

from expert_svc.dist_hub import CLIENT_RANK, DistHub
from expert_svc.errors import BadForward, OverBudget, UnknownExperts
from expert_svc.shard import ExpertShard
from moemesh.rpc.protos import load
from moemesh.telemetry.gpu import UNAVAILABLE, GpuTelemetry
from moemesh.transport.codec import CodecError, decode, encode, parse_dtype, check_shape

expert_pb2, expert_grpc = load("expert")
log = logging.getLogger(__name__)

STATUS = {
    UnknownExperts: grpc.StatusCode.FAILED_PRECONDITION,
    BadForward: grpc.StatusCode.INVALID_ARGUMENT,
    CodecError: grpc.StatusCode.INVALID_ARGUMENT,
    OverBudget: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class CallFailed(Exception):
    """A Forward that fails with `code` (a grpc.StatusCode) and `message`."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def status_of(e: Exception) -> grpc.StatusCode | None:
    for cls, code in STATUS.items():
        if isinstance(e, cls):
            return code
    return None


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

    async def _call(self, fn, *args, inline: bool = False):
        """fn(*args) on the compute pool (or here, `inline`); failures raise `CallFailed` with their status."""
        try:
            if inline:
                return fn(*args)
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        except (UnknownExperts, BadForward, CodecError, OverBudget) as e:
            raise CallFailed(status_of(e), str(e)) from None
        except Exception as e:  # noqa: BLE001 - e.g. an unreadable checkpoint: report, keep serving
            log.exception("%s failed", getattr(fn, "__name__", "call"))
            raise CallFailed(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}") from None

    async def _run(self, context, fn, *args, inline: bool = False):
        """`_call`, with a failure ending the RPC with its status."""
        try:
            return await self._call(fn, *args, inline=inline)
        except CallFailed as e:
            await context.abort(e.code, e.message)

    async def _forward_rows(self, request) -> torch.Tensor:
        """y for a request carrying x (grouped rows, or tokens with weights)."""
        if not request.HasField("x"):
            raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, "x is missing (and dist is not set)")
        try:
            x = decode(request.x, field="x", max_bytes=self.max_bytes, ndim=2)
        except CodecError as e:
            raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return await self._call(self._computation(request, x), inline=x.numel() <= self.inline_max_elements)

    async def Forward(self, request, context):
        self.shard.stats.enter()
        try:
            if request.HasField("dist"):
                await self._run(context, self._forward_dist, request)
                return expert_pb2.ForwardResponse()
            try:
                y = await self._forward_rows(request)
            except CallFailed as e:
                await context.abort(e.code, e.message)
            return expert_pb2.ForwardResponse(y=encode(y))
        finally:
            self.shard.stats.leave()

    async def ForwardStream(self, request_iterator, context):
        """Forward calls on one stream, answered in order; a failed call answers with its status in
        the message and the stream goes on. Dist requests use Forward (they wait on the link)."""
        async for request in request_iterator:
            self.shard.stats.enter()
            try:
                if request.HasField("dist"):
                    raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, "dist requests go through Forward, not ForwardStream")
                resp = expert_pb2.ForwardResponse(call_id=request.call_id, y=encode(await self._forward_rows(request)))
            except CallFailed as e:
                resp = expert_pb2.ForwardResponse(call_id=request.call_id, error_code=e.code.value[0], error=e.message)
            finally:
                self.shard.stats.leave()
            yield resp

    def _computation(self, request, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The request's compute on x, as a call whose domain errors `_run` maps to statuses:
        grouped rows, or combined on the server when the request carries weights."""
        def compute() -> torch.Tensor:
            if not request.HasField("weights"):
                return self.shard.forward(request.layer, x, list(request.expert_ids), list(request.counts))
            if len(request.counts):
                raise BadForward("counts must be empty when weights is set (every expert computes every row of x)")
            weights = decode(request.weights, field="weights", max_bytes=self.max_bytes, ndim=2)
            return self.shard.forward_weighted(request.layer, x, list(request.expert_ids), weights)

        compute.__name__ = "forward"
        return compute

    def _forward_dist(self, request) -> None:
        """Receive x over the link, compute, send y back with the same tag (runs on the pool)."""
        d = request.dist
        if self.dist is None:
            raise BadForward("dist: this server offers no torch.distributed transport")
        try:
            link = self.dist.link(d.link_id)
        except KeyError:
            raise BadForward(f"dist.link_id {d.link_id!r} is unknown: call OpenDistLink first") from None
        shape = check_shape(list(d.shape), "dist")
        if len(shape) != 2:
            raise BadForward(f"dist.shape {list(shape)} must have 2 dimensions")
        x = link.recv(shape, parse_dtype(d.dtype, "dist"), d.tag)  # [N, H] (or [T, H] with weights)
        try:
            y = self._computation(request, x)()
        except Exception:
            link.send(torch.zeros_like(x), d.tag)  # the client is waiting on this tag: release it, then report
            raise
        link.send(y, d.tag)

    async def LoadExperts(self, request, context):
        for le in request.experts:
            await self._run(context, self.shard.load, le.layer, list(le.expert_ids))
        return expert_set(self.shard.held())

    async def DropExperts(self, request, context):
        for le in request.experts:
            await self._run(context, self.shard.drop, le.layer, list(le.expert_ids))
        return expert_set(self.shard.held())

    async def GetStats(self, request, context):
        return stats_message(self.shard, reset=request.reset, gpu=self.gpu)

    async def OpenDistLink(self, request, context):
        if self.dist is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this server offers no torch.distributed transport (transport=grpc)")
        try:
            link_id = self.dist.open(request.client_id, request.host_id)
        except ValueError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return expert_pb2.OpenDistLinkResponse(link_id=link_id, store_addr=self.dist.addr, backend=self.dist.backend, client_rank=CLIENT_RANK)


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
    )
