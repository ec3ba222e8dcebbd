"""Running an expert server as a process: `python -m expert_svc --model-dir DIR [...]`.

Once serving it prints `moemesh expert_svc: serving HOST:PORT [dist=HOST:PORT] [id=SERVER_ID] [metrics=HOST:PORT]`
(flushed) on stdout.
With `--control-addr` it registers, heartbeats and takes LoadExperts/DropExperts from the control
plane. SIGTERM/SIGINT drain it: health NOT_SERVING, tell the control plane (which moves this server's
experts to the others when they have room, and drops them here once attention runs on the new
placement), let in-flight calls finish (all within `--drain-timeout-s`), deregister, stop.
"""
from __future__ import annotations

import asyncio
import logging
import sys
from typing import NoReturn

from control_svc.wire import ServerInfo
from expert_svc.config import ExpertServerConfig
from expert_svc.control_agent import ControlAgent
from expert_svc.server import ExpertServerParts, build_expert_server
from expert_svc.servicer import stats_message
from moemesh.rpc.server import exit_process, run_service
from moemesh.svc_config import parse_config

READY = "moemesh expert_svc: serving"
log = logging.getLogger("expert_svc")


def server_info(parts: ExpertServerParts) -> ServerInfo:
    cfg = parts.cfg
    return ServerInfo(
        server_id="",
        address=parts.address,
        device=cfg.device,
        memory_bytes=cfg.memory_bytes,
        slot_budget=cfg.slot_budget,
        host_id=parts.dist.host_id if parts.dist else "",
        dist_addr=parts.dist.addr if parts.dist else "",
    )


async def run(cfg: ExpertServerConfig, stop: asyncio.Event) -> None:
    if cfg.num_threads:
        import torch

        torch.set_num_threads(cfg.num_threads)
    parts = build_expert_server(cfg)
    await parts.server.start()
    agent = None
    beats = None
    try:
        if cfg.control_addr:
            agent = ControlAgent(cfg.control_addr, cfg.rpc, server_info(parts), lambda: stats_message(parts.shard, gpu=parts.gpu))
            placement = await agent.register()
            for layer, experts in placement.experts_on(agent.server_id).items():  # a re-registered server
                await asyncio.to_thread(parts.shard.load, layer, experts)
            beats = asyncio.create_task(agent.heartbeat_forever())
        extra = (f" dist={parts.dist.addr}" if parts.dist else "") + (f" id={agent.server_id}" if agent else "")
        extra += f" metrics={cfg.host}:{parts.metrics_server.port}" if parts.metrics_server else ""
        print(f"{READY} {parts.address}{extra}", flush=True)
        await stop.wait()
        await drain(parts, agent, cfg.drain_timeout_s)
    finally:
        if beats:
            beats.cancel()
        if agent:
            await agent.close()
        await parts.server.stop(0)


STOP_GRACE_S = 1.0  # after the drain, the grace of calls other than expert calls


async def drain(parts: ExpertServerParts, agent: ControlAgent | None, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    await parts.server.set_serving(False)
    if agent and await agent.drain():
        # the control plane switches in a placement without us and drops our experts at release,
        # once every attention replica runs on it: until then we keep answering
        while parts.shard.held() and loop.time() < deadline and await agent.still_moving():
            await asyncio.sleep(0.05)
    while parts.shard.stats.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.02)
    if agent:
        await agent.deregister()
    # expert calls are done (or out of time); what is left is open ForwardStreams, which never end on
    # their own, and short calls (stats, health): give those a moment, not the whole drain timeout
    await parts.server.stop(min(STOP_GRACE_S, max(0.0, deadline - loop.time())))
    log.info("drained: %d calls still in flight at stop", parts.shard.stats.in_flight)


def serve(cfg: ExpertServerConfig) -> None:
    """Serve until SIGTERM/SIGINT (on uvloop), then drain and return."""
    run_service(lambda stop: run(cfg, stop))


def main(argv: list[str] | None = None) -> NoReturn:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    cfg = parse_config(ExpertServerConfig, "expert", argv, prog="python -m expert_svc")
    serve(cfg)
    exit_process(0)
