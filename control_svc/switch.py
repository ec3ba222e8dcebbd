"""The placement change protocol (DESIGN section 5): prepare -> commit -> release.

prepare  every server loads the experts the new placement gives it and it does not hold yet,
         while still serving the old placement;
commit   the new version (with the routing knobs it carries) is published; attention replicas adopt
         it at a step boundary;
release  once every live attention replica reports the new version (or after a timeout), servers
         drop the copies only the old placement used.
The initial placement is the same path with an empty old placement.

Prepare and commit of one change at a time run under a lock. The wait for adoption does not hold
it (a failover must not queue behind a slow release); the drops then take the lock again and
skip every copy the placement committed by then names, so a later change that re-adds a copy is
never undone. Dead servers are never called. A change that cannot be prepared (a server fails to
load, or the placement names unknown or dead servers) raises MeshError ABORTED and the old
placement stays committed.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Callable, Mapping, Protocol

import grpc

from control_svc.board import PlacementBoard, PlacementView
from control_svc.placement import placement_diff
from moemesh.contracts.info import ServerInfo
from moemesh.contracts.knobs import MoeKnobs
from moemesh.contracts.placement import LayerExperts, Placement
from moemesh.errors import MeshError

log = logging.getLogger(__name__)


class ExpertServerOps(Protocol):
    """The calls the control plane makes on expert servers (`GrpcExpertOps`; fakes in tests)."""

    async def load(self, server: ServerInfo, experts: LayerExperts, version: int) -> float | None: ...  # seconds spent loading, if known
    async def drop(self, server: ServerInfo, experts: LayerExperts, version: int) -> None: ...
    async def ping(self, server: ServerInfo, timeout_s: float) -> None: ...
    async def forget(self, server_id: str) -> None: ...


# build(current view) -> (placement, knobs) to switch to, or None for no change; its version is
# set by the switch (current + 1, and above every version reported to the control plane)
Build = Callable[[PlacementView], "tuple[Placement, MoeKnobs] | None"]


class PlacementSwitch:
    def __init__(
        self,
        ops: ExpertServerOps,
        board: PlacementBoard,
        servers: Callable[[], Mapping[str, ServerInfo]],
        adopted: Callable[[], list[int | None]],
        prepare_timeout_s: float,
        release_timeout_s: float,
        floor: Callable[[], int] = lambda: 0,
        on_loaded: Callable[[int, float], None] = lambda copies, seconds: None,
    ):
        """servers(): id -> ServerInfo of known servers; adopted(): versions live attention replicas run;
        floor(): the newest version anyone reported (e.g. from before a control plane restart):
        renumbered placements are numbered above it, so replicas adopt them; on_loaded(copies, seconds):
        one server's prepare call loaded `copies` in `seconds` (the cost model's rate)."""
        self.ops = ops
        self.board = board
        self.servers = servers
        self.adopted = adopted
        self.floor = floor
        self.prepare_timeout_s = prepare_timeout_s
        self.release_timeout_s = release_timeout_s
        self.on_loaded = on_loaded
        self._lock = asyncio.Lock()  # one prepare + commit at a time
        self.running = 0  # changes between prepare and the end of release

    async def switch(self, new: Placement, knobs: MoeKnobs | None = None) -> None:
        """Switch to `new` exactly (its version must exceed the committed one); knobs default to the current ones."""
        await self.switch_with(lambda view: (new, knobs if knobs is not None else view.knobs), renumber=False)

    async def switch_with(self, build: Build, renumber: bool = True) -> PlacementView | None:
        """Evaluate `build` on the committed view under the lock and switch to its result (numbered
        max(current, floor()) + 1 when `renumber`). Returns the committed view, or None when `build`
        returned None."""
        self.running += 1
        try:
            async with self._lock:
                current = self.board.current
                built = build(current)
                if built is None:
                    return None
                new, knobs = built
                if renumber:
                    new = dataclasses.replace(new, version=max(current.placement.version, self.floor()) + 1)
                diff = placement_diff(current.placement, new)
                known = self.servers()
                missing = sorted(set(new.servers()) - set(known))
                if missing:
                    raise MeshError(grpc.StatusCode.ABORTED, f"placement v{new.version} names unknown servers {missing}")
                dead = sorted(s for s in new.servers() if known[s].state == "dead")
                if dead:
                    raise MeshError(grpc.StatusCode.ABORTED, f"placement v{new.version} names dead servers {dead}")
                await self.prepare(diff.loads, known, new.version)
                dead = tuple(sorted(s for s, info in known.items() if info.state == "dead"))
                view = PlacementView(new, tuple(known[s] for s in new.servers()), knobs, dead)
                await self.board.publish(view)
                log.info("placement v%d committed over %d servers (%s)", new.version, len(new.servers()), knobs.describe())
            await self.release(diff.drops, new.version)
            return view
        finally:
            self.running -= 1

    async def prepare(self, to_load: dict[str, LayerExperts], known: Mapping[str, ServerInfo], version: int) -> None:
        async def timed(server: ServerInfo, experts: LayerExperts) -> None:
            loop = asyncio.get_running_loop()
            start = loop.time()
            reported = await self.ops.load(server, experts, version)
            # the server's own loading seconds leave out the pauses it takes to spare its calls
            self.on_loaded(sum(len(es) for es in experts.values()), reported or loop.time() - start)

        calls = [timed(known[s], experts) for s, experts in to_load.items()]
        start = asyncio.get_running_loop().time()
        try:
            await asyncio.wait_for(asyncio.gather(*calls), self.prepare_timeout_s)
        except Exception as e:
            raise MeshError(grpc.StatusCode.ABORTED, f"prepare of placement v{version} failed: {e}") from e
        if to_load:
            log.info("prepared placement v%d: %d expert copies loaded on %d servers in %.2fs", version,
                     sum(len(es) for layers in to_load.values() for es in layers.values()), len(to_load),
                     asyncio.get_running_loop().time() - start)

    async def wait_adopted(self, version: int, timeout_s: float) -> bool:
        """Until every live attention replica runs `version` or later (True), or `timeout_s` passed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while any(v is None or v < version for v in self.adopted()):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def release(self, to_drop: dict[str, LayerExperts], version: int) -> None:
        if not to_drop:
            return
        await self.wait_adopted(version, self.release_timeout_s)
        async with self._lock:
            committed = self.board.current.placement
            known = self.servers()
            calls = []
            for s, layers in to_drop.items():
                if s not in known or known[s].state == "dead":
                    continue
                held = committed.experts_on(s)
                keep = {l: tuple(e for e in es if e not in held.get(l, ())) for l, es in layers.items()}
                keep = {l: es for l, es in keep.items() if es}
                if keep:
                    calls.append(self.ops.drop(known[s], keep, version))
            results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, Exception):  # an old copy that stays loaded costs memory, not correctness
                log.warning("release after placement v%d: %s", version, r)
