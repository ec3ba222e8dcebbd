"""`PlacementBoard`: the committed placement (with the servers it names) and its watchers."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator

from moemesh.contracts.info import ServerInfo
from moemesh.contracts.knobs import MoeKnobs
from moemesh.contracts.placement import Placement


@dataclass(frozen=True)
class PlacementView:
    placement: Placement
    servers: tuple[ServerInfo, ...]  # every server the placement names
    knobs: MoeKnobs = MoeKnobs()  # top-k / capacity in force with this version
    dead: tuple[str, ...] = ()  # servers declared dead when it was committed (their calls will not be answered)


class PlacementBoard:
    def __init__(self) -> None:
        self.current = PlacementView(Placement(version=0), ())
        self._changed = asyncio.Condition()

    @property
    def version(self) -> int:
        return self.current.placement.version

    async def publish(self, view: PlacementView) -> None:
        if view.placement.version <= self.version:
            raise ValueError(f"placement version {view.placement.version} must exceed the committed {self.version}")
        async with self._changed:
            self.current = view
            self._changed.notify_all()

    async def watch(self, after_version: int) -> AsyncIterator[PlacementView]:
        """Every committed view newer than `after_version`, as it is committed (the latest first)."""
        seen = after_version
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: self.version > seen)
                view = self.current
            seen = view.placement.version
            yield view
