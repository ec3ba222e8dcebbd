"""An attention replica as a server: remote experts and the control follower (with a control
plane), engine, step loop, servicer, gRPC server, /metrics.

    server, port = await create_server(cfg)   # bound, not started (port 0 picks a free one)
    await server.start()                      # the step loop runs, the gRPC server serves
    await server.shutdown()                   # no new sequences; running ones get the grace period

`run(cfg, stop)` does that around `stop` and prints `moemesh attention_svc: serving HOST:PORT
[metrics=HOST:PORT]` once serving.

The step loop is watched: should its task ever end while serving (it survives failed steps, so
this means the replica is broken), health turns NOT_SERVING, every stream ends UNAVAILABLE and
`run` raises `ServiceFailed`, so the process exits non-zero and its supervisor restarts it.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

import grpc

from attention_svc.config import AttentionConfig
from attention_svc.control_follower import ControlFollower, engine_knob_setter
from attention_svc.remote_experts import RemoteExperts
from attention_svc.replica import AttentionReplica
from attention_svc.servicer import SERVICE_NAME, AttentionServicer, pb_grpc
from attention_svc.step_loop import StepLoop
from moemesh.engine import LLMEngine
from moemesh.engine.device import select_device
from moemesh.errors import MeshError, ServiceFailed
from moemesh.rpc.server import MeshServer, Service, build_server, print_ready
from moemesh.telemetry import MetricsServer, ServiceMetrics
from moemesh.transport.dist_transport import open_transport

log = logging.getLogger(__name__)


class AttentionServer:
    """The gRPC server, the engine's step loop, and (with a control plane) the remote experts and the
    control follower it owns."""

    def __init__(self, mesh: MeshServer, port: int, replica: AttentionReplica, experts: RemoteExperts | None,
                 follower: ControlFollower | None, cfg: AttentionConfig, metrics_server: MetricsServer | None) -> None:
        self.mesh = mesh
        self.port = port
        self.replica = replica
        self.experts = experts
        self.follower = follower
        self.cfg = cfg
        self.metrics_server = metrics_server  # /metrics when cfg.metrics_port is set
        self._loop_task: asyncio.Task | None = None
        self._stopping = False
        self.failure: str | None = None  # why the step loop ended, once it has
        self.failed = asyncio.Event()

    @property
    def address(self) -> str:
        return f"{self.cfg.host}:{self.port}"

    async def start(self) -> None:
        self._loop_task = asyncio.create_task(self.replica.loop.run())
        self._loop_task.add_done_callback(self._loop_ended)
        await self.mesh.start()

    def _loop_ended(self, task: asyncio.Task) -> None:
        if self._stopping:
            return
        exc = None if task.cancelled() else task.exception()
        self.failure = f"attention: the engine step loop stopped ({'cancelled' if exc is None else f'{type(exc).__name__}: {exc}'})"
        log.error("%s: health NOT_SERVING, exiting to be restarted", self.failure)
        self.replica.serving = False
        self.replica.loop.fail_all(MeshError(grpc.StatusCode.UNAVAILABLE, f"{self.failure}; this replica is restarting"))
        asyncio.get_running_loop().create_task(self.mesh.set_serving(False))
        self.failed.set()

    async def serve_until(self, stop: asyncio.Event) -> None:
        """Returns when `stop` is set; raises ServiceFailed as soon as the step loop has ended."""
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self.failed.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if self.failed.is_set():
            raise ServiceFailed(self.failure)

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Health NOT_SERVING and no new sequences; running ones get the grace period to finish."""
        self._stopping = True
        self.replica.serving = False
        await self.mesh.shutdown(grace_s)
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loop_task
        self.replica.loop.close()
        await close_experts(self.experts, self.follower)
        if self.metrics_server is not None:
            self.metrics_server.stop()


async def close_experts(experts: RemoteExperts | None, follower: ControlFollower | None) -> None:
    if follower is not None:
        await follower.close()
    if experts is not None:
        await asyncio.to_thread(experts.close)  # closing dist links waits on their peers


async def create_server(cfg: AttentionConfig) -> tuple[AttentionServer, int]:
    select_device(cfg.engine.device)  # the CUDA device is current before the expert links or the engine allocate
    experts = follower = None  # without a control plane the engine computes its experts in process
    try:
        if cfg.control_addr:
            follower = ControlFollower(cfg.control_addr, cfg.rpc)
            placement, servers = await follower.first_placement()
            transport_for = functools.partial(open_transport, mode=cfg.transport, rpc=cfg.rpc)
            experts = RemoteExperts(placement, servers, transport_for, follower.report_failure, cfg.failover_timeout_s)
        engine = await asyncio.to_thread(LLMEngine, cfg.engine, experts)
        metrics = ServiceMetrics("attention", scheduler=engine.stats)
        wake = asyncio.Event()
        loop = StepLoop(engine, between_steps=follower.begin_step if follower else lambda: None, on_step=metrics.observe_step, wake=wake)
        replica = AttentionReplica(engine, loop, lambda: experts.placement.version if experts else 0)
        mesh = build_server(cfg.rpc, Service(pb_grpc.add_AttentionServicer_to_server, AttentionServicer(replica), SERVICE_NAME))
        port = mesh.bind(f"{cfg.host}:{cfg.port}")
        if follower is not None:
            await follower.start(experts, f"{cfg.host}:{port}", engine_knob_setter(engine), wake.set)
    except BaseException:
        await close_experts(experts, follower)
        raise
    metrics_server = metrics.serve(cfg.metrics_port, cfg.host) if cfg.metrics_port is not None else None
    return AttentionServer(mesh, port, replica, experts, follower, cfg, metrics_server), port


async def run(cfg: AttentionConfig, stop: asyncio.Event) -> None:
    """Serve until `stop` is set, then drain (health NOT_SERVING, grace period); raises
    ServiceFailed (after stopping) when the step loop ended."""
    server, _ = await create_server(cfg)
    await server.start()
    try:
        print_ready("attention", server.address, metrics=server.metrics_server and f"{cfg.host}:{server.metrics_server.port}")
        await server.serve_until(stop)
    finally:
        await server.shutdown()
