"""`ExpertServicer`: moemesh.v1.ExpertService <-> `ExpertShard`. Translation and status codes only."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable

import grpc
import numpy as np
import torch

from expert_svc.dist_hub import CLIENT_RANK, DistHub
from expert_svc.load_pacing import LoadPacer, cpu_timed
from expert_svc.shard import ExpertShard
from moemesh.contracts.wire import held_to_proto
from moemesh.errors import MeshError, invalid
from moemesh.rpc.protos import load
from moemesh.telemetry.gpu import UNAVAILABLE, GpuTelemetry
from moemesh.transport.base import ExpertRequest
from moemesh.transport.codec import CodecError, decode, encode

SERVICE_NAME = "moemesh.v1.ExpertService"
expert_pb2, expert_grpc = load("expert")
log = logging.getLogger(__name__)


def to_request(msg) -> ExpertRequest:
    """A ForwardRequest as an `ExpertRequest` (its tensors view the message's bytes); what the values
    mean is the shard's check."""
    try:
        for name in ("x", "token_idx", "weights"):
            if not msg.HasField(name):
                raise invalid(f"{name}: missing")
        x, token_idx, weights = decode(msg.x, "x"), decode(msg.token_idx, "token_idx"), decode(msg.weights, "weights")
    except CodecError as e:
        raise invalid(str(e)) from None
    # the repeated fields read straight into int64 arrays (about half the time of torch.tensor over a list)
    ids = torch.from_numpy(np.fromiter(msg.expert_ids, dtype=np.int64, count=len(msg.expert_ids)))
    counts = torch.from_numpy(np.fromiter(msg.counts, dtype=np.int64, count=len(msg.counts)))
    return ExpertRequest(msg.layer, msg.placement_version, x, token_idx, weights, ids, counts)


def failure_of(e: Exception, what: str) -> MeshError:
    """A MeshError as it is; anything else (e.g. an unreadable checkpoint) as INTERNAL, logged."""
    if isinstance(e, MeshError):
        return e
    log.error("%s failed", what, exc_info=e)
    return MeshError(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")


class ExpertServicer(expert_grpc.ExpertServiceServicer):
    def __init__(
        self, shard: ExpertShard, pool: ThreadPoolExecutor, dist: DistHub | None = None,
        gpu: GpuTelemetry | None = None, inline_max_elements: int = 0, pacer: LoadPacer | None = None,
    ):
        """inline_max_elements: a call whose rows x hidden is at most this (a decode-sized call) is
        computed on the event loop itself instead of the pool (0 = never). With one compute thread the
        pool runs calls one at a time anyway, and its two thread hand-offs per call (loop -> pool ->
        loop) are a large part of a small call's latency; larger calls (prefill) stay on the pool so
        health checks and heartbeats are never held up long. The shard's layers are immutable
        snapshots, so a LoadExperts running on the pool meanwhile stays safe. pacer: the pauses between
        the layers of a LoadExperts or DropExperts while the server serves (`load_pacing`)."""
        self.inline_max_elements = inline_max_elements
        self.pacer = pacer  # loads and drops while serving (None: no pauses)
        self.gpu = gpu
        self.shard = shard
        self.pool = pool
        self.dist = dist
        # with a control plane: `ControlAgent.check_drop`, which refuses drops of experts still placed here
        self.drop_guard: Callable[[dict[int, list[int]]], Awaitable[None]] | None = None
        # held by LoadExperts / DropExperts and by the server sorting out its copies after it registered
        # again (`ExpertServer._registered_again`), so neither undoes the other halfway
        self.changing = asyncio.Lock()
        # (layer, expert) -> the newest placement version a LoadExperts or DropExperts changed it for
        self.changed_at: dict[tuple[int, int], int] = {}
        self.version_seen: Callable[[int], None] = lambda version: None  # the placement version of each Load/Drop

    async def _call(self, fn, *args, inline: bool = False):
        """fn(*args) on the compute pool (or here, `inline`); failures raise MeshError with their status."""
        try:
            if inline:
                return fn(*args)
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        except Exception as e:  # noqa: BLE001 - reported with its status; the server keeps serving
            raise failure_of(e, getattr(fn, "__name__", "call")) from None

    async def _run(self, context, fn, *args):
        """`_call` on the pool, with a failure ending the RPC with its status."""
        try:
            return await self._call(fn, *args)
        except MeshError as e:
            await context.abort(e.code, e.message)

    async def ForwardStream(self, request_iterator, context):
        """Calls on one stream, answered in order; a failed call answers with its status in the
        message and the stream goes on."""
        async for request in request_iterator:
            self.shard.stats.enter()
            # this thread's CPU decoding the request and encoding the answer (the forward reports its
            # own, kernel and rest apart: it may run on the pool); an await in between would count
            # other calls' CPU, so each part is timed on its own
            cpu = 0.0
            try:
                decoding = time.thread_time()
                req = to_request(request)
                inline = req.token_idx.numel() * self.shard.model.hidden_size <= self.inline_max_elements
                cpu = time.thread_time() - decoding
                y = await self._call(self.shard.forward, req, inline=inline)
                encoding = time.thread_time()
                resp = expert_pb2.ForwardResponse(call_id=request.call_id)
                encode(y, out=resp.y)  # written in place: a Tensor message passed as y= would be copied once more
                cpu += time.thread_time() - encoding
            except MeshError as e:
                resp = expert_pb2.ForwardResponse(call_id=request.call_id, error_code=e.code.value[0], error=e.message)
            finally:
                self.shard.stats.leave(cpu)
            yield resp

    async def _change(self, context, fn, request):
        """fn(layer, experts) for each layer of `request` on the pool, under `self.changing` (one change
        at a time), paced by `self.pacer` between layers; each layer's experts marked changed at the
        request's placement version; the ExpertSet held after, with the seconds spent changing (pauses
        left out)."""
        changing = 0.0
        async with self.changing:
            for le in request.experts:
                start = time.monotonic()
                _, cpu_s = await self._run(context, cpu_timed(fn), le.layer, list(le.expert_ids))
                elapsed = time.monotonic() - start
                self.shard.stats.changed(cpu_s)
                changing += elapsed
                self._changed(le, request.placement_version)
                if self.pacer is not None:
                    await asyncio.sleep(self.pacer.pause(cpu_s, elapsed, self.shard.stats.since_call()))
        out = held_to_proto(self.shard.held())
        out.change_seconds = changing
        return out

    async def LoadExperts(self, request, context):
        return await self._change(context, self.shard.load, request)

    def _changed(self, le, version: int) -> None:
        self.version_seen(version)
        for e in le.expert_ids:
            self.changed_at[(le.layer, e)] = max(self.changed_at.get((le.layer, e), 0), version)

    async def DropExperts(self, request, context):
        if self.drop_guard is not None:
            try:
                await self.drop_guard({le.layer: list(le.expert_ids) for le in request.experts})
            except MeshError as e:
                await context.abort(e.code, e.message)
        return await self._change(context, self.shard.drop, request)

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
        held=held_to_proto(shard.held()),
        gpu=gpu_message(gpu),
        window_work=expert_pb2.ExpertWork(**{k: (int(v) if k in ("requests", "expert_calls", "rows") else v) for k, v in snap.work.items()},
                                          cpu_limit=snap.cpu_limit or 0.0),
    )
