"""The placement change protocol (DESIGN section 5): prepare -> commit -> release.

prepare  every server loads the experts the new placement gives it and it does not hold yet,
         while still serving the old placement;
commit   the new version is published; attention replicas adopt it at a step boundary;
release  once every live attention replica reports the new version (or after a timeout), servers
         drop the copies only the old placement used.
The initial placement is the same path with an empty old placement.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, Mapping, Protocol

from control_svc.board import PlacementBoard, PlacementView
from control_svc.placement.types import Placement
from control_svc.wire import ServerInfo

log = logging.getLogger(__name__)

LayerExperts = dict[int, tuple[int, ...]]


class ExpertServerOps(Protocol):
    async def load(self, server: ServerInfo, experts: LayerExperts, version: int) -> None: ...
    async def drop(self, server: ServerInfo, experts: LayerExperts, version: int) -> None: ...


def placement_diff(old: Placement, new: Placement) -> tuple[dict[str, LayerExperts], dict[str, LayerExperts]]:
    """(to_load, to_drop): server -> layer -> experts new gives it that old did not, and the reverse."""

    def minus(a: Placement, b: Placement) -> dict[str, LayerExperts]:
        out: dict[str, LayerExperts] = {}
        for server in a.servers():
            held_b = b.experts_on(server)
            for layer, experts in a.experts_on(server).items():
                extra = tuple(e for e in experts if e not in held_b.get(layer, ()))
                if extra:
                    out.setdefault(server, {})[layer] = extra
        return out

    return minus(new, old), minus(old, new)


class SwitchError(RuntimeError):
    """A placement change could not be prepared; the old placement stays committed."""


class PlacementSwitch:
    def __init__(
        self,
        ops: ExpertServerOps,
        board: PlacementBoard,
        servers: Callable[[], Mapping[str, ServerInfo]],
        adopted: Callable[[], list[int | None]],
        prepare_timeout_s: float,
        release_timeout_s: float,
    ):
        """servers(): id -> ServerInfo of known servers; adopted(): versions live attention replicas run."""
        self.ops = ops
        self.board = board
        self.servers = servers
        self.adopted = adopted
        self.prepare_timeout_s = prepare_timeout_s
        self.release_timeout_s = release_timeout_s
        self._lock = asyncio.Lock()  # one change at a time

    async def switch(self, new: Placement) -> None:
        async with self._lock:
            old = self.board.current.placement
            to_load, to_drop = placement_diff(old, new)
            known = self.servers()
            missing = sorted(set(new.servers()) - set(known))
            if missing:
                raise SwitchError(f"placement v{new.version} names unknown servers {missing}")
            await self.prepare(to_load, known, new.version)
            await self.board.publish(PlacementView(new, tuple(known[s] for s in new.servers())))
            log.info("placement v%d committed over %d servers", new.version, len(new.servers()))
            await self.release(to_drop, known, new.version)

    async def prepare(self, to_load: dict[str, LayerExperts], known: Mapping[str, ServerInfo], version: int) -> None:
        calls = [self.ops.load(known[s], experts, version) for s, experts in to_load.items()]
        try:
            await asyncio.wait_for(asyncio.gather(*calls), self.prepare_timeout_s)
        except Exception as e:
            raise SwitchError(f"prepare of placement v{version} failed: {e}") from e

    async def release(self, to_drop: dict[str, LayerExperts], known: Mapping[str, ServerInfo], version: int) -> None:
        if not to_drop:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.release_timeout_s
        while any(v is None or v < version for v in self.adopted()) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        results = await asyncio.gather(
            *[self.ops.drop(known[s], experts, version) for s, experts in to_drop.items() if s in known], return_exceptions=True
        )
        for r in results:
            if isinstance(r, Exception):  # an old copy that stays loaded costs memory, not correctness
                log.warning("release after placement v%d: %s", version, r)
