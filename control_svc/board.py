"""`PlacementBoard`: the committed placement (with the servers it names) and its watchers."""
from __future__ import annotations

import asyncio
import dataclasses
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
    dead: tuple[str, ...] = ()  # servers declared dead so far (their calls will not be answered)


class PlacementBoard:
    def __init__(self) -> None:
        self.current = PlacementView(Placement(version=0), ())
        self._changed = asyncio.Condition()
        self._notices = 0  # death notices published (`note_dead`)

    @property
    def version(self) -> int:
        return self.current.placement.version

    async def publish(self, view: PlacementView) -> None:
        if view.placement.version <= self.version:
            raise ValueError(f"placement version {view.placement.version} must exceed the committed {self.version}")
        async with self._changed:
            self.current = view
            self._changed.notify_all()

    async def note_dead(self, dead: tuple[str, ...]) -> None:
        """Servers declared dead (all so far): watchers get the committed view again with them listed,
        without waiting for the placement that drops them (which may take loads, or not come at all
        when the others have no room), so replicas fail the calls waiting on them at once."""
        async with self._changed:
            if self.version == 0 or set(dead) <= set(self.current.dead):
                return
            self.current = dataclasses.replace(self.current, dead=tuple(sorted(set(dead) | set(self.current.dead))))
            self._notices += 1
            self._changed.notify_all()

    async def watch(self, after_version: int) -> AsyncIterator[PlacementView]:
        """Every committed view newer than `after_version`, as it is committed (the latest first), and
        the committed view again after each death notice (first of all when one came with the version
        the watcher already has)."""
        seen = after_version
        notices = self._notices - 1 if self.current.dead and after_version == self.version else self._notices
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: self.version > seen or self._notices > notices)
                view, notices = self.current, self._notices
            seen = max(seen, view.placement.version)
            yield view
