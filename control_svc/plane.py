"""`ControlPlane`: registry + placement board + switch, and when to place experts.

Once `expected_expert_servers` servers are serving and no placement exists, the initial placement
(round robin within slot budgets) goes through prepare -> commit -> release as version 1.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from control_svc.board import PlacementBoard
from control_svc.evacuate import evacuate
from control_svc.initial_placement import round_robin_placement
from control_svc.registry import Registry
from control_svc.switch import ExpertServerOps, PlacementSwitch
from control_svc.wire import ServerInfo

log = logging.getLogger(__name__)


class ControlPlane:
    def __init__(
        self,
        moe_layers: tuple[int, ...],
        num_experts: int,
        expected_expert_servers: int,
        ops: ExpertServerOps,
        heartbeat_interval_s: float,
        dead_after_s: float,
        prepare_timeout_s: float,
        release_timeout_s: float,
        registry: Registry | None = None,
    ):
        self.moe_layers = moe_layers
        self.num_experts = num_experts
        self.expected = expected_expert_servers
        self.heartbeat_interval_s = heartbeat_interval_s
        self.dead_after_s = dead_after_s
        self.registry = registry or Registry()
        self.board = PlacementBoard()
        self.switch = PlacementSwitch(
            ops,
            self.board,
            lambda: {s.server_id: s for s in self.registry.servers()},
            lambda: [r.adopted_version for r in self.registry.live_attention()],
            prepare_timeout_s,
            release_timeout_s,
        )
        self._initial: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # placement changes running in the background
        self.moving: set[str] = set()  # draining servers whose experts are being moved away

    def register_expert(self, info: ServerInfo) -> ServerInfo:
        rec = self.registry.register_expert(info)
        log.info("expert server %s registered at %s (%s)", rec.server_id, rec.address, rec.device)
        if self.board.version == 0 and len(self.registry.serving()) >= self.expected and self._initial is None:
            self._initial = asyncio.get_running_loop().create_task(self.place_initial())
        return rec

    async def place_initial(self) -> None:
        servers = [(s.server_id, s.slot_budget) for s in self.registry.serving()]
        try:
            placement = round_robin_placement(self.moe_layers, self.num_experts, servers, version=1)
            await self.switch.switch(placement)
        except Exception:
            log.exception("initial placement failed; it is retried on the next registration")
            self._initial = None

    async def wait_placed(self, timeout_s: float) -> None:
        """Until some placement is committed (tests and `moemesh up` wait on this)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.board.version == 0:
            if loop.time() > deadline:
                raise TimeoutError(f"no placement committed within {timeout_s}s")
            await asyncio.sleep(0.02)

    def drain(self, server_id: str) -> tuple[str, bool]:
        """Mark `server_id` draining and, when the others have room, switch in a placement without
        it (its experts are dropped from it at release). Returns (state, moving)."""
        state = self.registry.drain(server_id)
        placement = self.board.current.placement
        if server_id not in placement.servers():
            return state, False
        others = [(s.server_id, s.slot_budget) for s in self.registry.serving()]
        try:
            new = evacuate(placement, server_id, others, version=placement.version + 1)
        except ValueError as e:
            log.warning("cannot move the experts of draining server %s: %s", server_id, e)
            return state, False
        self.moving.add(server_id)
        self._background(self.switch.switch(new), f"evacuating {server_id}", lambda: self.moving.discard(server_id))
        return state, True

    def _background(self, coro, what: str, then: Callable[[], None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)

        def finished(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            then()
            if not t.cancelled() and t.exception() is not None:
                log.error("%s failed: %s", what, t.exception())

        task.add_done_callback(finished)

    def heartbeat(self, id_: str, adopted_version: int | None, stats: Any) -> bool:
        return self.registry.heartbeat(id_, adopted_version, stats)

    async def reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            for server_id in self.registry.reap(self.dead_after_s):
                log.warning("expert server %s missed its heartbeats: marked dead", server_id)
