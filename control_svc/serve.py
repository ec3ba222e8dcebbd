"""Running the control plane as a process: `python -m control_svc --model-dir DIR [...]`.

Once serving it prints `moemesh control_svc: serving HOST:PORT [metrics=HOST:PORT]` (flushed) on stdout;
it reaps silent servers (failover) and, with `--rebalance-interval-s`, rebalances periodically. SIGTERM/SIGINT
stop it (health NOT_SERVING, grace period).
"""
from __future__ import annotations

import asyncio
import logging
import sys

from control_svc.config import ControlConfig
from control_svc.server import build_control_server
from moemesh.rpc.server import run_service
from moemesh.svc_config import parse_config

READY = "moemesh control_svc: serving"


async def run(cfg: ControlConfig, stop: asyncio.Event) -> None:
    parts = build_control_server(cfg)
    await parts.server.start()
    loops = [asyncio.create_task(parts.plane.reap_forever())]
    if cfg.rebalance_interval_s > 0:
        loops.append(asyncio.create_task(parts.plane.rebalance_forever()))
    try:
        extra = f" metrics={cfg.host}:{parts.metrics_server.port}" if parts.metrics_server else ""
        print(f"{READY} {parts.address}{extra}", flush=True)
        await stop.wait()
    finally:
        for task in loops:
            task.cancel()
        await parts.server.shutdown()
        await parts.ops.close()


def serve(cfg: ControlConfig) -> None:
    """Serve until SIGTERM/SIGINT (on uvloop), then drain and return."""
    run_service(lambda stop: run(cfg, stop))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    cfg = parse_config(ControlConfig, "control", argv, prog="python -m control_svc")
    serve(cfg)
    return 0
