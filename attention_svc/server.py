"""The attention replica process: `create_server(cfg) -> (AttentionServer, port)` and `serve(cfg)`."""
from __future__ import annotations

import asyncio
import contextlib

from attention_svc.config import AttentionConfig
from attention_svc.experts import ExpertBackend, open_experts
from attention_svc.replica import AttentionReplica
from attention_svc.servicer import SERVICE_NAME, AttentionServicer, pb_grpc
from attention_svc.step_loop import StepLoop
from moemesh.rpc.server import MeshServer, Service, build_server, run_service
from moemesh.telemetry import MetricsServer, ServiceMetrics


class AttentionServer:
    """The gRPC server, the engine's step loop and the expert backend it owns."""

    def __init__(self, mesh: MeshServer, replica: AttentionReplica, experts: ExpertBackend) -> None:
        self.mesh = mesh
        self.replica = replica
        self.experts = experts
        self.metrics_server: MetricsServer | None = None  # /metrics when cfg.metrics_port is set
        self._loop_task: asyncio.Task | None = None

    async def start(self) -> None:
        self._loop_task = asyncio.create_task(self.replica.loop.run())
        await self.mesh.start()

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Health NOT_SERVING and no new sequences; running ones get the grace period to finish."""
        self.replica.serving = False
        await self.mesh.shutdown(grace_s)
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        self.replica.loop.close()
        await self.experts.close()
        if self.metrics_server is not None:
            self.metrics_server.stop()


async def create_server(cfg: AttentionConfig) -> tuple[AttentionServer, int]:
    from moemesh.engine import LLMEngine
    from moemesh.engine.device import select_device

    select_device(cfg.engine.device)  # the CUDA device is current before the expert links or the engine allocate
    experts = await open_experts(cfg)
    engine = await asyncio.to_thread(LLMEngine, cfg.engine, experts.compute)
    metrics = ServiceMetrics("attention")
    loop = StepLoop(engine, between_steps=experts.begin_step, on_step=metrics.observe_step)
    experts.on_placement = loop.wake
    if experts.compute is not None:  # routing knobs arrive with placement versions
        from attention_svc.remote_backend import engine_knob_setter

        experts.apply_knobs = engine_knob_setter(engine)
    replica = AttentionReplica(engine, loop, experts.placement_version)
    mesh = build_server(cfg.rpc, Service(pb_grpc.add_AttentionServicer_to_server, AttentionServicer(replica), SERVICE_NAME))
    port = mesh.add_insecure_port(f"{cfg.host}:{cfg.port}")
    await experts.register(f"{cfg.host}:{port}")
    server = AttentionServer(mesh, replica, experts)
    if cfg.metrics_port is not None:
        server.metrics_server = metrics.serve(cfg.metrics_port, cfg.host)
    return server, port


async def run(cfg, stop: asyncio.Event) -> None:
    """Serve until `stop` is set, then drain gracefully (health NOT_SERVING, grace period)."""
    server, port = await create_server(cfg)
    await server.start()
    try:
        extra = f" metrics={cfg.host}:{server.metrics_server.port}" if server.metrics_server else ""
        print(f"moemesh attention_svc: serving {cfg.host}:{port}{extra}", flush=True)
        await stop.wait()
    finally:
        await server.shutdown()


def serve(cfg) -> None:
    """Run the attention until SIGTERM/SIGINT."""
    run_service(lambda stop: run(cfg, stop))
